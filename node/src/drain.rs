//! `dynamoctl drain WORKER`: stop new work for a worker and wait for its
//! in-flight requests to finish (graceful scale-down); `--resume` undoes it.
//!
//! The worker is named by its id or an unambiguous prefix of it. Routers
//! skip a draining worker as soon as its registration says so; a request
//! that races the change is refused by the worker and retried elsewhere by
//! the gateway, so draining loses nothing.

use dynamo_bus_schema::{DrainReply, DrainRequest, Namespace, WorkerId, WorkerRegistration};
use dynamo_runtime::bus::REGISTRY_MAX_AGE;
use dynamo_runtime::Bus;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// What `drain` was asked to do.
pub struct DrainSpec {
    /// Worker id (hex) or a unique prefix.
    pub worker: String,
    /// Take requests again instead of draining.
    pub resume: bool,
    /// How long to wait for in-flight requests (zero: do not wait).
    pub wait: Duration,
}

/// The registered worker whose id is, or starts with, `name`.
pub(crate) async fn find_worker(bus: &Bus, name: &str) -> anyhow::Result<WorkerId> {
    let kv = bus
        .kv_bucket(&bus.subjects.workers_bucket(), REGISTRY_MAX_AGE)
        .await?;
    // Keys from the stream's subjects: a `keys()` consumer may not end
    // while heartbeats write the bucket.
    let regs = dynamo_controller::read_all::<WorkerRegistration>(&kv)
        .await
        .map_err(|e| anyhow::anyhow!("reading the worker registry: {e}"))?;
    let found: Vec<WorkerId> = regs
        .values()
        .map(|r| r.worker_id)
        .filter(|w| w.to_string().starts_with(name))
        .collect();
    match found.as_slice() {
        [one] => Ok(*one),
        [] => anyhow::bail!("no registered worker matches {name:?} (see dynamoctl status)"),
        many => anyhow::bail!(
            "{name:?} matches {} workers; give more of the id",
            many.len()
        ),
    }
}

async fn ask(bus: &Bus, id: WorkerId, resume: bool) -> anyhow::Result<DrainReply> {
    bus.request(
        bus.subjects.worker_drain(id),
        &DrainRequest { resume },
        Duration::from_secs(5),
    )
    .await
    .map_err(|e| anyhow::anyhow!("worker {id} did not answer: {e}"))
}

/// Drains (or resumes) a worker; returns the final report as JSON. Fails
/// when the worker is unknown or still busy after `wait`.
pub async fn run(url: &str, ns: Namespace, spec: DrainSpec) -> anyhow::Result<Value> {
    if spec.worker.is_empty() {
        anyhow::bail!("give a worker id (see dynamoctl status)");
    }
    let bus = crate::access::cli_connect(url, ns).await?;
    let id = find_worker(&bus, &spec.worker).await?;
    let t0 = Instant::now();
    let mut reply = ask(&bus, id, spec.resume).await?;
    while !spec.resume && reply.inflight > 0 && t0.elapsed() < spec.wait {
        tokio::time::sleep(Duration::from_millis(200)).await;
        reply = ask(&bus, id, false).await?;
    }
    let report = json!({
        "worker_id": id.to_string(),
        "state": format!("{:?}", reply.state).to_lowercase(),
        "inflight": reply.inflight,
        "drained": !spec.resume && reply.inflight == 0,
        "waited_ms": t0.elapsed().as_millis() as u64,
    });
    if !spec.resume && reply.inflight > 0 && !spec.wait.is_zero() {
        anyhow::bail!(
            "worker {id} still has {} request(s) in flight after {:?}: {report}",
            reply.inflight,
            spec.wait
        );
    }
    Ok(report)
}
