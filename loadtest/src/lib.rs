//! rolter-loadtest: an OpenAI-compatible upstream stub, a vLLM fleet simulator and a load driver.

pub mod stub;
