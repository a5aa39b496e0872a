//! Responses API affinity on the request path: which target a request naming a stored
//! response must reach (`previous_response_id`, or `/v1/responses/{id}[/...]`), and the
//! requests that name one in their path.
//!
//! The table itself is `routing::ResponseAffinity`, held by the runtime; answers teach it
//! (see `Gateway::exchange`). A known response whose replica is gone or ineligible is an
//! error naming it (503), never a silent other replica; an unknown id in a path is 404.

use super::error::GatewayError;
use super::{Gateway, ModelRewrite, Prepared, RequestCtx};
use crate::fleet::{ms_at, now_ms};
use crate::routing::responses::Pinned;
use crate::routing::RouteInput;
use crate::runtime::{Route, RouteTable, Runtime};
use pingora::proxy::Session;
use std::time::Instant;

/// Paths naming a stored response start with this.
pub(super) const BY_ID_PREFIX: &str = "/v1/responses/";
/// Their `endpoint` label.
pub(super) const BY_ID_LABEL: &str = "responses_by_id";

/// The index in `route` of the target holding response `id`: `None` if the id is not
/// known (route as usual: the replica answers 404), an error if its replica is not in
/// this route any more or may not be chosen now.
pub(super) fn home_in_route(
    runtime: &Runtime,
    route: &Route,
    id: &str,
) -> Result<Option<usize>, GatewayError> {
    let Some(home) = runtime.responses().home(id, now_ms()) else {
        return Ok(None);
    };
    let unavailable = |reason| GatewayError::ResponseHomeUnavailable {
        id: id.to_string(),
        target: home.to_string(),
        reason,
    };
    let index = route
        .targets
        .iter()
        .position(|t| t.state.label() == &*home)
        .ok_or_else(|| unavailable("it is not a target of this model"))?;
    if !route.targets[index].state.eligible(now_ms()) {
        return Err(unavailable(
            "it is unhealthy, cooling down or its circuit is open",
        ));
    }
    Ok(Some(index))
}

/// The route and target index holding response `id`, over every route.
fn home_anywhere<'t>(
    runtime: &Runtime,
    table: &'t RouteTable,
    id: &str,
) -> Result<(&'t std::sync::Arc<Route>, usize), GatewayError> {
    let home = runtime
        .responses()
        .home(id, now_ms())
        .ok_or_else(|| GatewayError::NotFound(format!("Response with id '{id}' not found.")))?;
    let found = table.routes_by_alias().find_map(|route| {
        let index = route
            .targets
            .iter()
            .position(|t| t.state.label() == &*home)?;
        Some((route, index))
    });
    let (route, index) = found.ok_or_else(|| GatewayError::ResponseHomeUnavailable {
        id: id.to_string(),
        target: home.to_string(),
        reason: "it is not configured any more",
    })?;
    if !route.targets[index].state.eligible(now_ms()) {
        return Err(GatewayError::ResponseHomeUnavailable {
            id: id.to_string(),
            target: home.to_string(),
            reason: "it is unhealthy, cooling down or its circuit is open",
        });
    }
    Ok((route, index))
}

impl Gateway {
    /// `GET` / `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`,
    /// `POST /v1/responses/{id}/cancel`: forwarded as they are to the replica holding
    /// the response.
    pub(super) async fn response_by_id(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        table: &RouteTable,
        method: &http::Method,
        path: &str,
    ) -> Result<(), GatewayError> {
        let rest = &path[BY_ID_PREFIX.len()..];
        let (id, tail) = rest.split_once('/').unwrap_or((rest, ""));
        let allowed: &[http::Method] = match tail {
            "" => &[http::Method::GET, http::Method::DELETE],
            "input_items" => &[http::Method::GET],
            "cancel" => &[http::Method::POST],
            _ => return Err(GatewayError::NotFound(format!("no such endpoint: {path}"))),
        };
        if id.is_empty() {
            return Err(GatewayError::NotFound(format!("no such endpoint: {path}")));
        }
        if !allowed.contains(method) {
            return Err(GatewayError::MethodNotAllowed(method.to_string()));
        }
        let (route, target) = home_anywhere(&self.runtime, table, id)?;
        ctx.route = Some(route.alias.clone());
        let (mut body, mut charged, _admitted) = self.read_and_admit(session, table).await?;
        ctx.body_bytes = body.len();
        let pinned = Pinned { target };
        ctx.strategy = crate::routing::Strategy::name(&pinned);
        let at = Instant::now();
        let client = self.client_info(session, table);
        let request = Prepared {
            input: RouteInput {
                now_ms: ms_at(at),
                ..Default::default()
            },
            body: &mut body,
            charged: &mut charged,
            model: ModelRewrite::None,
            learn: false,
            client,
            at,
        };
        self.forward(session, ctx, table, route, &pinned, request)
            .await
    }
}
