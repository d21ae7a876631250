//! State shared by every HTTP handler of one gateway.

use crate::admission::Admission;
use crate::config::GatewayConfig;
use crate::error::ApiError;
use crate::inbox::Inbox;
use crate::metrics::Metrics;
use crate::models::ModelCache;
use crate::preprocess::PreprocessPool;
use dynamo_bus_schema::GatewayId;
use dynamo_router::{RouterMsg, ROUTER_ACTOR_NAME};
use dynamo_runtime::{Bus, Gate, Spawner};
use ractor::ActorRef;
use std::sync::atomic::{AtomicBool, Ordering};

/// Status requests (`/health`, `/metrics`, `/v1/models`, overlap) served
/// at once: each asks the router, whose mailbox they must not flood.
pub const CONTROL_CONCURRENCY: usize = 64;

pub struct Shared {
    pub bus: Bus,
    pub gateway_id: GatewayId,
    pub frames_subject: String,
    pub inbox: Inbox,
    pub config: GatewayConfig,
    pub metrics: Metrics,
    pub models: ModelCache,
    pub admission: Admission,
    pub preprocess: PreprocessPool,
    /// Bounds status requests (see [`CONTROL_CONCURRENCY`]).
    pub control: Gate,
    /// Spawns the gateway's short-lived tasks (cancels, streams).
    pub spawner: Spawner,
    pub accepting: AtomicBool,
    /// Fires when a shutdown's grace period is over: streams still open
    /// end with an error event rather than a cut connection.
    pub grace_over: tokio_util::sync::CancellationToken,
    pub started_unix_s: u64,
    /// Traffic summaries for the planner.
    pub feed: crate::feed::Feed,
    /// API keys and their limits (none: open).
    pub auth: std::sync::Arc<crate::auth::Auth>,
    /// Recent events for the cluster page.
    pub events: crate::dashboard::Events,
    /// Requests waiting for a worker with room.
    pub room: crate::dispatch::Room,
}

impl Shared {
    /// The router actor, looked up by name so a restarted router is found.
    pub fn router(&self) -> Result<ActorRef<RouterMsg>, ApiError> {
        ractor::registry::where_is(ROUTER_ACTOR_NAME)
            .map(ActorRef::<RouterMsg>::from)
            .ok_or_else(|| ApiError::unavailable("The router is restarting; retry shortly."))
    }

    /// Every worker the router knows (any state).
    pub async fn workers(&self) -> Result<Vec<dynamo_router::registry::WorkerEntry>, ApiError> {
        match self
            .router()?
            .call(RouterMsg::Workers, Some(std::time::Duration::from_secs(2)))
            .await
        {
            Ok(ractor::rpc::CallResult::Success(w)) => Ok(w),
            _ => Err(ApiError::unavailable(
                "The router did not answer; retry shortly.",
            )),
        }
    }

    pub fn is_accepting(&self) -> bool {
        self.accepting.load(Ordering::Relaxed)
    }
}
