//! The desired state of deployments (deployments bucket): read, written
//! by compare-and-set, and scaled. `dynamoctl apply|scale` and the planner
//! change it only through here, so both take the same path.
//!
//! Invariants: every change bumps the deployment's generation and is a
//! compare-and-set on the entry's revision (a loser retries on the new
//! state, so two concurrent changes never lose one another); a stored spec
//! always parses into checked types.
//!
//! Fencing a lease holder (the planner): it checks its lease (a renewal,
//! itself a compare-and-set on the lease entry) *after* reading the record
//! ([`prepare_scale`]) and writes by compare-and-set on the revision read
//! ([`Prepared::commit`]); a new holder [`touch`]es the record before it
//! acts and decides only from a read after the touch. A takeover is a
//! compare-and-set on the lease entry too, so it comes after the old
//! holder's last successful check, and so after that check's read: the
//! touch bumps the revision the old holder read, and its write fails.

use async_nats::jetstream::kv;
use dynamo_bus_schema::{decode, encode, unix_ms, DeploymentRecord};
use dynamo_cluster_config::spec::DeploymentSpec;
use thiserror::Error;

/// Attempts of one change against concurrent writers.
pub const ATTEMPTS: usize = 5;

#[derive(Debug, Error)]
pub enum DesiredError {
    #[error("no deployment {0:?} (see dynamoctl get deployments)")]
    NoDeployment(String),
    #[error(transparent)]
    Spec(#[from] dynamo_cluster_config::spec::SpecError),
    #[error("deployment {0} kept changing under us; try again")]
    Contended(String),
    #[error("the deployments bucket: {0}")]
    Bus(String),
    #[error("a stored deployment record does not decode: {0}")]
    Decode(dynamo_bus_schema::DecodeError),
}

// Not `#[from]`: the message already shows the cause, and a source would
// print it twice in a chain (`{:#}`).
impl From<dynamo_bus_schema::DecodeError> for DesiredError {
    fn from(e: dynamo_bus_schema::DecodeError) -> Self {
        DesiredError::Decode(e)
    }
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
        match prepare_scale(store, name, target, replicas).await? {
            Scale::Unchanged(generation) => return Ok((generation, false)),
            Scale::Ready(p) => {
                if let Ok(generation) = p.commit(store).await {
                    return Ok((generation, true));
                }
            }
        }
    }
    Err(DesiredError::Contended(name.to_string()))
}

/// A scale read and checked, not yet written.
pub enum Scale {
    /// The target already has that many replicas: nothing to write (the
    /// current generation).
    Unchanged(u64),
    Ready(Box<Prepared>),
}

/// A change ready to write over the record it was read from.
pub struct Prepared {
    spec: DeploymentSpec,
    prev: (DeploymentRecord, u64),
}

impl Prepared {
    /// Writes it by compare-and-set on the revision it was read at (fails
    /// when the record changed since, or was touched); the generation
    /// written.
    pub async fn commit(self, store: &kv::Store) -> Result<u64, DesiredError> {
        write(store, &self.spec, Some(self.prev)).await
    }
}

/// Reads the deployment and sets a target's replicas in its spec. A lease
/// holder checks its lease after this and before [`Prepared::commit`]
/// (see the module docs); a failed commit starts again from here.
pub async fn prepare_scale(
    store: &kv::Store,
    name: &str,
    target: &str,
    replicas: u32,
) -> Result<Scale, DesiredError> {
    let Some((rec, rev)) = record(store, name).await? else {
        return Err(DesiredError::NoDeployment(name.to_string()));
    };
    let mut spec = DeploymentSpec::parse(&rec.spec_yaml)?;
    let before = spec.target_replicas(target);
    spec.scale(target, replicas)?;
    if before == Some(replicas) {
        return Ok(Scale::Unchanged(rec.generation));
    }
    Ok(Scale::Ready(Box::new(Prepared {
        spec,
        prev: (rec, rev),
    })))
}

/// Writes the deployment's record again unchanged (same generation), so
/// that a write a deposed lease holder prepared before now fails its
/// compare-and-set; false when there is no such deployment. A new lease
/// holder calls it before it acts.
pub async fn touch(store: &kv::Store, name: &str) -> Result<bool, DesiredError> {
    let bus = |e: &dyn std::fmt::Display| DesiredError::Bus(e.to_string());
    for _ in 0..ATTEMPTS {
        let entry = store.entry(name).await.map_err(|e| bus(&e))?;
        match entry {
            Some(e) if e.operation == kv::Operation::Put => {
                if store.update(name, e.value, e.revision).await.is_ok() {
                    return Ok(true);
                }
            }
            _ => return Ok(false),
        }
    }
    Err(DesiredError::Contended(name.to_string()))
}

#[cfg(test)]
mod tests {
    use super::DesiredError;

    /// Every message in an error's chain, as `{:#}` prints it.
    fn chain(e: &dyn std::error::Error) -> String {
        let mut out = e.to_string();
        let mut cause = e.source();
        while let Some(c) = cause {
            out.push_str(": ");
            out.push_str(&c.to_string());
            cause = c.source();
        }
        out
    }

    /// A cause shows once in a chain, not again as a source.
    #[test]
    fn a_cause_is_shown_once() {
        let spec = dynamo_cluster_config::spec::DeploymentSpec::parse("version: 2\nname: d\n")
            .expect_err("version 2");
        let msg = spec.to_string();
        let e = DesiredError::from(spec);
        assert_eq!(chain(&e).matches(&msg).count(), 1, "{}", chain(&e));
        let d = dynamo_bus_schema::DecodeError::TooShort { len: 1 };
        let msg = d.to_string();
        let e = DesiredError::from(d);
        assert_eq!(chain(&e).matches(&msg).count(), 1, "{}", chain(&e));
        assert!(chain(&e).starts_with("a stored deployment record does not decode: "));
    }
}
