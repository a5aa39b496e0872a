//! Route tokenizers kept across routing-table generations. A reload whose route names the
//! same directory (its files unchanged in size and modification time) with the same cache
//! bound reuses the loaded tokenizer and its warm prefix-ids cache instead of parsing the
//! files again; a changed file is loaded afresh.
//!
//! Owns only the loaded tokenizers; it must not be read on the request path (routes hold
//! their own `Arc`).

use super::{LoadError, RouteTokenizer};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

/// The files a tokenizer directory is read from.
const FILES: [&str; 4] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
];

/// Size and modification time of each of [`FILES`] (`None`: absent or unreadable).
type Stamp = [Option<(u64, Option<SystemTime>)>; 4];

fn stamp(dir: &Path) -> Stamp {
    FILES.map(|f| {
        std::fs::metadata(dir.join(f))
            .ok()
            .map(|m| (m.len(), m.modified().ok()))
    })
}

/// A tokenizer's directory and cache bound.
type Key = (PathBuf, usize);

/// A tokenizer as one build got it, to be kept if that build is installed.
pub struct Loaded {
    key: Key,
    stamp: Stamp,
    /// The tokenizer the route uses.
    pub tokenizer: Arc<RouteTokenizer>,
}

/// The tokenizers of the live table, by directory and cache bound.
#[derive(Default)]
pub struct TokenizerBoard {
    loaded: parking_lot::Mutex<HashMap<Key, (Stamp, Arc<RouteTokenizer>)>>,
}

impl TokenizerBoard {
    /// The tokenizer of `dir` with a cache of `cache_bytes`: the live one if its files have
    /// not changed since it was loaded, else loaded now. Changes nothing on the board.
    pub fn get_or_load(&self, dir: &Path, cache_bytes: usize) -> Result<Loaded, LoadError> {
        // Taken before the files are read: a file changed while loading differs from the
        // stamp, so the next reload loads it again.
        let stamp = stamp(dir);
        let key = (dir.to_path_buf(), cache_bytes);
        if let Some((s, t)) = self.loaded.lock().get(&key) {
            if *s == stamp {
                let tokenizer = t.clone();
                return Ok(Loaded {
                    key,
                    stamp,
                    tokenizer,
                });
            }
        }
        let tokenizer = Arc::new(RouteTokenizer::load(dir, cache_bytes)?);
        Ok(Loaded {
            key,
            stamp,
            tokenizer,
        })
    }

    /// The installed table uses exactly `used`: keep those, forget the rest.
    pub fn keep(&self, used: Vec<Loaded>) {
        *self.loaded.lock() = used
            .into_iter()
            .map(|l| (l.key, (l.stamp, l.tokenizer)))
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_copy(tag: &str) -> PathBuf {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/llama3");
        let dir =
            std::env::temp_dir().join(format!("rolter-tokboard-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(src.join(f), dir.join(f)).unwrap();
        }
        dir
    }

    #[test]
    fn an_unchanged_directory_is_reused_and_a_changed_one_reloaded() {
        let dir = fixture_copy("reuse");
        let board = TokenizerBoard::default();
        let first = board.get_or_load(&dir, 1 << 20).unwrap();
        let t1 = first.tokenizer.clone();
        // Not kept yet (the build was not installed): loaded again.
        let again = board.get_or_load(&dir, 1 << 20).unwrap();
        assert!(!Arc::ptr_eq(&t1, &again.tokenizer));
        board.keep(vec![first]);
        let same = board.get_or_load(&dir, 1 << 20).unwrap();
        assert!(Arc::ptr_eq(&t1, &same.tokenizer), "unchanged files: reused");
        // Another cache bound is another tokenizer.
        let other = board.get_or_load(&dir, 2 << 20).unwrap();
        assert!(!Arc::ptr_eq(&t1, &other.tokenizer));
        // A file rewritten (a new modification time): loaded afresh.
        let config = dir.join("tokenizer_config.json");
        let file = std::fs::File::options().write(true).open(&config).unwrap();
        file.set_modified(SystemTime::now() + std::time::Duration::from_secs(5))
            .unwrap();
        drop(file);
        let changed = board.get_or_load(&dir, 1 << 20).unwrap();
        assert!(
            !Arc::ptr_eq(&t1, &changed.tokenizer),
            "a changed file: reloaded"
        );
        // keep() forgets what the new table does not use.
        board.keep(vec![]);
        assert!(!Arc::ptr_eq(
            &t1,
            &board.get_or_load(&dir, 1 << 20).unwrap().tokenizer
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
