//! The desired state of deployments (deployments bucket): read, written
//! by compare-and-set, and scaled. `dynamoctl apply|scale` and the planner
//! change it only through here, so both take the same path.
//!
//! Invariants: every change bumps the deployment's generation and is a
//! compare-and-set on the entry's revision (a loser retries on the new
//! state, so two concurrent changes never lose one another); a stored spec
//! always parses into checked types.

use async_nats::jetstream::kv;
use dynamo_bus_schema::{decode, encode, unix_ms, DeploymentRecord};
use dynamo_cluster_config::spec::DeploymentSpec;
use thiserror::Error;

/// Attempts of one change against concurrent writers.
const ATTEMPTS: usize = 5;

#[derive(Debug, Error)]
pub enum DesiredError {
    #[error("no deployment {0:?} (see dynamoctl get deployments)")]
    NoDeployment(String),
    #[error("{0}")]
    Spec(#[from] dynamo_cluster_config::spec::SpecError),
    #[error("deployment {0} kept changing under us; try again")]
    Contended(String),
    #[error("the deployments bucket: {0}")]
    Bus(String),
    #[error("a stored deployment record does not decode: {0}")]
    Decode(#[from] dynamo_bus_schema::DecodeError),
}

/// The deployment's record and its entry's revision.
pub async fn record(
    store: &kv::Store,
    name: &str,
) -> Result<Option<(DeploymentRecord, u64)>, DesiredError> {
    match store
        .entry(name)
        .await
        .map_err(|e| DesiredError::Bus(e.to_string()))?
    {
        Some(e) if e.operation == kv::Operation::Put => {
            Ok(Some((decode::<DeploymentRecord>(&e.value)?, e.revision)))
        }
        _ => Ok(None),
    }
}

/// Writes `spec` as the deployment's next generation, by compare-and-set
/// on `prev`'s revision (None: it must not exist yet).
pub async fn write(
    store: &kv::Store,
    spec: &DeploymentSpec,
    prev: Option<(DeploymentRecord, u64)>,
) -> Result<u64, DesiredError> {
    // A new deployment starts at the clock (in ms), so one applied again
    // after a delete never reuses a generation an old status still names.
    let generation = prev
        .as_ref()
        .map(|(r, _)| r.generation + 1)
        .unwrap_or_else(unix_ms);
    let rec = DeploymentRecord {
        name: spec.name.clone(),
        spec_yaml: spec.to_yaml()?,
        generation,
        updated_unix_ms: unix_ms(),
    };
    let bytes: bytes::Bytes = encode(&rec)
        .map_err(|e| DesiredError::Bus(e.to_string()))?
        .into();
    let bus = |e: &dyn std::fmt::Display| DesiredError::Bus(e.to_string());
    match prev {
        Some((_, rev)) => store
            .update(&spec.name, bytes, rev)
            .await
            .map_err(|e| bus(&e))?,
        None => store.create(&spec.name, bytes).await.map_err(|e| bus(&e))?,
    };
    Ok(generation)
}

/// Sets a service's or group's replicas; the generation written, or the
/// current one when it already had that many (nothing written).
pub async fn scale(
    store: &kv::Store,
    name: &str,
    target: &str,
    replicas: u32,
) -> Result<(u64, bool), DesiredError> {
    for _ in 0..ATTEMPTS {
        let Some((rec, rev)) = record(store, name).await? else {
            return Err(DesiredError::NoDeployment(name.to_string()));
        };
        let mut spec = DeploymentSpec::parse(&rec.spec_yaml)?;
        let before = spec.target_replicas(target);
        spec.scale(target, replicas)?;
        if before == Some(replicas) {
            return Ok((rec.generation, false));
        }
        if let Ok(generation) = write(store, &spec, Some((rec, rev))).await {
            return Ok((generation, true));
        }
    }
    Err(DesiredError::Contended(name.to_string()))
}
