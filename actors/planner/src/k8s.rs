//! The planner's Kubernetes side, for a deployment that runs there
//! (`PlannerConfig::kubernetes_namespace`): each tick reads its targets'
//! replicas back from Grove's objects, and a decision patches them.
//!
//! Invariants:
//! - on Kubernetes a target's desired replicas are the API server's
//!   (`spec.replicas`), read every tick: nothing writes the desired state
//!   there, and a `kubectl scale` by hand is seen as any outside change is;
//! - a patch is made only on a reading of the same tick, and is applied
//!   only if the object's count is still the one read (a JSON Patch
//!   `test`), so a change it has not seen (a `kubectl scale` since,
//!   another planner's patch) makes the patch fail rather than be
//!   overwritten;
//! - a tick whose read-back fails decides nothing (the actor logs why and
//!   tries again next tick): a planner never acts on counts it could not
//!   read;
//! - one client per planner, made on first use and dropped after a failed
//!   call, so rotated credentials are read again; every call is bounded
//!   (`dynamo_controller::bounded`);
//! - without the `k8s-client` feature every call fails, naming the
//!   feature.

use dynamo_cluster_config::render::connector::ObservedScale;
use dynamo_cluster_config::spec::DeploymentSpec;
use std::collections::BTreeMap;

/// The Kubernetes connector of one planner.
pub struct K8s {
    namespace: String,
    /// The latest reading of each target: its count is the precondition
    /// of the next patch.
    #[cfg(feature = "k8s-client")]
    last: BTreeMap<String, ObservedScale>,
    /// Pins already warned about (target, replicas), so one that cannot be
    /// applied is not logged every tick.
    warned: std::collections::BTreeSet<(String, u32)>,
    #[cfg(feature = "k8s-client")]
    scaler: Option<dynamo_cluster_config::render::connector::KubeScaler>,
}

#[cfg(not(feature = "k8s-client"))]
const NO_CLIENT: &str =
    "this build has no Kubernetes client (build dynamo-planner-actor with the k8s-client feature)";

impl K8s {
    pub fn new(namespace: impl Into<String>) -> Self {
        K8s {
            namespace: namespace.into(),
            #[cfg(feature = "k8s-client")]
            last: BTreeMap::new(),
            warned: Default::default(),
            #[cfg(feature = "k8s-client")]
            scaler: None,
        }
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Whether a pin that could not be applied should be logged (once per
    /// target and count).
    pub fn first_warning(&mut self, target: &str, replicas: u32) -> bool {
        self.warned.insert((target.to_string(), replicas))
    }

    #[cfg(feature = "k8s-client")]
    async fn scaler(
        &mut self,
    ) -> Result<dynamo_cluster_config::render::connector::KubeScaler, String> {
        use dynamo_cluster_config::render::connector::KubeScaler;
        if self.scaler.is_none() {
            let s = dynamo_controller::bounded(
                "Kubernetes client",
                KubeScaler::try_default(self.namespace.clone()),
            )
            .await?;
            self.scaler = Some(s);
        }
        self.scaler
            .clone()
            .ok_or_else(|| "no Kubernetes client".to_string())
    }

    /// Sets `target`'s replicas in its Grove object, on condition that the
    /// object is as this planner last read it.
    #[cfg(feature = "k8s-client")]
    pub async fn scale(
        &mut self,
        spec: &DeploymentSpec,
        target: &str,
        replicas: u32,
    ) -> Result<(), String> {
        use dynamo_cluster_config::render::connector::ScaleTarget;
        let t = ScaleTarget::for_spec(spec, target).map_err(|e| e.to_string())?;
        let Some(expect) = self.last.get(target).map(|o| o.desired) else {
            return Err(format!(
                "no reading of {} {} this tick: not patched",
                t.kind.kind(),
                t.name
            ));
        };
        let scaler = self.scaler().await?;
        let what = format!("scaling {} {}", t.kind.kind(), t.name);
        match dynamo_controller::bounded(&what, scaler.scale(&t, replicas, Some(expect))).await {
            Ok(after) => {
                self.last.insert(target.to_string(), after);
                Ok(())
            }
            Err(e) => {
                self.scaler = None;
                self.last.remove(target);
                Err(e)
            }
        }
    }

    /// Reads each of `targets`' replicas back from its Grove object; any
    /// failure fails the whole read.
    #[cfg(feature = "k8s-client")]
    pub async fn observe(
        &mut self,
        spec: &DeploymentSpec,
        targets: &[String],
    ) -> Result<BTreeMap<String, ObservedScale>, String> {
        use dynamo_cluster_config::render::connector::ScaleTarget;
        let scaler = self.scaler().await?;
        let mut out = BTreeMap::new();
        for name in targets {
            let t = ScaleTarget::for_spec(spec, name).map_err(|e| e.to_string())?;
            let what = format!("reading {} {}", t.kind.kind(), t.name);
            match dynamo_controller::bounded(&what, scaler.observe(&t)).await {
                Ok(o) => {
                    out.insert(name.clone(), o);
                }
                Err(e) => {
                    self.scaler = None;
                    self.last.clear();
                    return Err(e);
                }
            }
        }
        self.last = out.clone();
        Ok(out)
    }

    #[cfg(not(feature = "k8s-client"))]
    pub async fn scale(
        &mut self,
        _spec: &DeploymentSpec,
        _target: &str,
        _replicas: u32,
    ) -> Result<(), String> {
        Err(NO_CLIENT.into())
    }

    #[cfg(not(feature = "k8s-client"))]
    pub async fn observe(
        &mut self,
        _spec: &DeploymentSpec,
        _targets: &[String],
    ) -> Result<BTreeMap<String, ObservedScale>, String> {
        Err(NO_CLIENT.into())
    }
}

#[cfg(all(test, not(feature = "k8s-client")))]
mod tests {
    use super::*;

    #[tokio::test]
    async fn without_the_client_every_call_fails_naming_the_feature() {
        let spec = DeploymentSpec::parse(
            "version: 1\nname: d\nservices:\n  w: {role: aggregated, worker: {engine: mocker, model: m}}\n",
        )
        .unwrap();
        let mut k = K8s::new("serving");
        assert_eq!(k.namespace(), "serving");
        let e = k.scale(&spec, "w", 2).await.unwrap_err();
        assert!(e.contains("k8s-client"), "{e}");
        let e = k.observe(&spec, &["w".to_string()]).await.unwrap_err();
        assert!(e.contains("k8s-client"), "{e}");
    }
}
