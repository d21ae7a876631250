//! Names of the Kubernetes objects a deployment renders to, and of those
//! Grove generates from them.
//!
//! Grove composes (see `operator/api/common/namegen.go` and the pod
//! component of ai-dynamo/grove):
//! - a standalone PodClique `<pcs>-<i>-<clique>`; its pods are created with
//!   `generateName: <pclq>-<k>-`, so a pod is `<pcs>-<i>-<clique>-<k>-<5 chars>`
//!   and its hostname `<pclq>-<k>`;
//! - a PodCliqueScalingGroup `<pcs>-<i>-<pcsg>`, its PodCliques
//!   `<pcs>-<i>-<pcsg>-<j>-<clique>` and their pods `…-<k>-<5 chars>`.
//!
//! Invariants checked by [`check_deployment`] (a failure names the object):
//! - every name here, for the highest index each level reaches (the PCS
//!   replica `i`, the group replica `j`, the pod index `k`, from the spec's
//!   replica counts), is a DNS-1123 label of at most [`MAX_LABEL`]
//!   characters;
//! - the PodCliqueSet, scaling group and clique names together take at most
//!   [`MAX_COMBINED`] characters, the limit Grove's admission webhook
//!   enforces for pod naming.

use super::RenderError;
use crate::spec::DeploymentSpec;

/// Longest DNS-1123 label (and Kubernetes label value).
pub const MAX_LABEL: usize = 63;
/// Grove's webhook limit on `len(pcs) + len(pcsg) + len(clique)`.
pub const MAX_COMBINED: usize = 45;
/// Random characters Kubernetes appends to a `generateName`.
pub const POD_SUFFIX: usize = 5;

/// Whether `s` is a DNS-1123 label: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most
/// [`MAX_LABEL`] characters.
pub fn is_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_LABEL
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// Whether `s` is a DNS-1123 subdomain: dot-separated labels, at most 253
/// characters.
pub fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns1123_label)
}

/// The PodClique Grove creates for a standalone clique.
pub fn podclique_name(pcs: &str, pcs_index: u32, clique: &str) -> String {
    format!("{pcs}-{pcs_index}-{clique}")
}

/// The PodCliqueScalingGroup Grove creates for a scaling-group config.
pub fn scaling_group_name(pcs: &str, pcs_index: u32, group: &str) -> String {
    format!("{pcs}-{pcs_index}-{group}")
}

/// The PodClique Grove creates for a clique in one scaling-group replica.
pub fn group_podclique_name(
    pcs: &str,
    pcs_index: u32,
    group: &str,
    group_index: u32,
    clique: &str,
) -> String {
    format!(
        "{}-{group_index}-{clique}",
        scaling_group_name(pcs, pcs_index, group)
    )
}

/// The longest pod name Grove can give pod `pod_index` of `podclique`
/// (the random suffix written as `x`s).
pub fn pod_name(podclique: &str, pod_index: u32) -> String {
    format!("{podclique}-{pod_index}-{}", "x".repeat(POD_SUFFIX))
}

/// What a pod name says: the service of the deployment whose pod it is
/// and, for a scaling-group member, which group replica it belongs to.
#[derive(Clone, Copy, Debug)]
pub struct PodOf<'a> {
    pub service: &'a crate::spec::ServiceSpec,
    /// The group replica `j` (a group member's pod), or `None`.
    pub group_replica: Option<u32>,
}

/// An index as Grove writes it: decimal, no leading zero, within `u32`.
fn index(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0'))
    {
        return None;
    }
    s.parse().ok()
}

/// Which service of `spec` the pod Grove named `pod` runs (in PodCliqueSet
/// replica 0, the one the renderer's objects and the connector use), by
/// the exact inverse of the names above, random suffix included, so one
/// service's name being a prefix of another's confuses nothing. `None` for
/// a name that is no such pod, and for one that two services' names could
/// both compose (a standalone `g-5-a` beside member `a` of group `g`):
/// an ambiguous pod is attributed to neither.
pub fn pod_of<'a>(spec: &'a DeploymentSpec, pod: &str) -> Option<PodOf<'a>> {
    // `<pclq>-<k>-<suffix>`
    let mut parts = pod.rsplitn(3, '-');
    let suffix = parts.next()?;
    let k = parts.next()?;
    let pclq = parts.next()?;
    if suffix.len() != POD_SUFFIX
        || !suffix
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return None;
    }
    index(k)?;
    let mut found = spec.services.iter().filter_map(|svc| match &svc.group {
        None => (pclq == podclique_name(&spec.name, 0, &svc.name)).then_some(PodOf {
            service: svc,
            group_replica: None,
        }),
        Some(g) => {
            // `<pcsg>-<j>-<clique>`
            let j = pclq
                .strip_prefix(&scaling_group_name(&spec.name, 0, g))
                .and_then(|r| r.strip_prefix('-'))
                .and_then(|r| r.strip_suffix(&svc.name))
                .and_then(|r| r.strip_suffix('-'))
                .and_then(index)?;
            Some(PodOf {
                service: svc,
                group_replica: Some(j),
            })
        }
    });
    let first = found.next()?;
    found.next().is_none().then_some(first)
}

/// The name of the ConfigMap holding a service's `node.toml`.
pub fn config_map_name(deployment: &str, service: &str) -> String {
    format!("{deployment}-{service}")
}

/// The name of the Service in front of a frontend.
pub fn service_name(deployment: &str, service: &str) -> String {
    format!("{deployment}-{service}")
}

fn label(object: impl Into<String>, name: &str) -> Result<(), RenderError> {
    if is_dns1123_label(name) {
        Ok(())
    } else {
        Err(RenderError::Name {
            object: object.into(),
            name: name.to_string(),
            message: format!(
                "is not a DNS-1123 label of at most {MAX_LABEL} characters ({} here): shorten the deployment, group or service name",
                name.len()
            ),
        })
    }
}

fn combined(object: String, parts: &[&str]) -> Result<(), RenderError> {
    let n: usize = parts.iter().map(|p| p.len()).sum();
    if n <= MAX_COMBINED {
        return Ok(());
    }
    Err(RenderError::Name {
        object,
        name: parts.join("+"),
        message: format!(
            "names total {n} characters; Grove allows at most {MAX_COMBINED} for the PodCliqueSet, scaling group and clique names of a pod"
        ),
    })
}

/// Checks every name the deployment renders to and every name Grove will
/// compose from it (PCS replica index 0: the renderer asks for 1 replica).
pub fn check_deployment(spec: &DeploymentSpec) -> Result<(), RenderError> {
    let pcs = spec.name.as_str();
    label("PodCliqueSet", pcs)?;
    let i = 0;
    for g in &spec.groups {
        label(format!("scaling group {}", g.name), &g.name)?;
        label(
            format!("PodCliqueScalingGroup of group {}", g.name),
            &scaling_group_name(pcs, i, &g.name),
        )?;
    }
    for s in &spec.services {
        label(format!("clique {}", s.name), &s.name)?;
        label(
            format!("ConfigMap of service {}", s.name),
            &config_map_name(pcs, &s.name),
        )?;
        if !s.role.is_worker() {
            label(
                format!("Service of frontend {}", s.name),
                &service_name(pcs, &s.name),
            )?;
        }
        let k = s.replicas.saturating_sub(1);
        match &s.group {
            None => {
                combined(format!("pods of clique {}", s.name), &[pcs, &s.name])?;
                let pclq = podclique_name(pcs, i, &s.name);
                label(format!("PodClique of service {}", s.name), &pclq)?;
                label(
                    format!("pod hostname of service {}", s.name),
                    &format!("{pclq}-{k}"),
                )?;
                label(format!("pod of service {}", s.name), &pod_name(&pclq, k))?;
            }
            Some(g) => {
                let j = spec
                    .group(g)
                    .map(|g| g.replicas.saturating_sub(1))
                    .unwrap_or(0);
                combined(
                    format!("pods of clique {} in scaling group {g}", s.name),
                    &[pcs, g, &s.name],
                )?;
                let pclq = group_podclique_name(pcs, i, g, j, &s.name);
                label(
                    format!("PodClique of service {} in scaling group {g}", s.name),
                    &pclq,
                )?;
                label(
                    format!("pod hostname of service {} in scaling group {g}", s.name),
                    &format!("{pclq}-{k}"),
                )?;
                label(
                    format!("pod of service {} in scaling group {g}", s.name),
                    &pod_name(&pclq, k),
                )?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_follow_dns_1123() {
        assert!(is_dns1123_label("a"));
        assert!(is_dns1123_label("disagg-0-prefill"));
        assert!(is_dns1123_label("0a"));
        assert!(!is_dns1123_label(""));
        assert!(!is_dns1123_label("-a"));
        assert!(!is_dns1123_label("a-"));
        assert!(!is_dns1123_label("A"));
        assert!(!is_dns1123_label("a.b"));
        assert!(is_dns1123_label(&"a".repeat(63)));
        assert!(!is_dns1123_label(&"a".repeat(64)));
        assert!(is_dns1123_subdomain("grove-topology"));
        assert!(is_dns1123_subdomain("a.b-c"));
        assert!(!is_dns1123_subdomain("a..b"));
    }

    #[test]
    fn grove_names_compose_like_grove() {
        assert_eq!(podclique_name("d", 0, "prefill"), "d-0-prefill");
        assert_eq!(scaling_group_name("d", 0, "pd"), "d-0-pd");
        assert_eq!(
            group_podclique_name("d", 0, "pd", 3, "decode"),
            "d-0-pd-3-decode"
        );
        assert_eq!(pod_name("d-0-prefill", 12), "d-0-prefill-12-xxxxx");
    }

    #[test]
    fn pods_map_back_to_their_service_exactly() {
        // `pre` is a prefix of `prefill`, and the group `pd` of the
        // standalone `pd-x`: neither confuses the inverse.
        let spec = DeploymentSpec::parse(
            r#"
version: 1
name: d
services:
  pre: {role: prefill, worker: {engine: mocker, model: m}}
  prefill: {role: prefill, worker: {engine: mocker, model: m}}
  pd-x: {role: decode, worker: {engine: mocker, model: m}}
  p: {role: prefill, worker: {engine: mocker, model: m}}
  dec: {role: decode, worker: {engine: mocker, model: m}}
groups:
  pd: {services: [p, dec], replicas: 2}
"#,
        )
        .unwrap();
        let of = |pod: &str| pod_of(&spec, pod).map(|p| p.service.name.as_str());
        for (pod, want) in [
            ("d-0-pre-0-a1b2c", Some("pre")),
            ("d-0-prefill-12-zz9zz", Some("prefill")),
            ("d-0-pd-x-0-abcde", Some("pd-x")),
            ("d-0-pd-1-p-0-abcde", Some("p")),
            ("d-0-pd-0-dec-3-abcde", Some("dec")),
            // Not pods of this deployment, or not pods at all.
            ("d-0-pd-1-p-0-abcd", None),
            // Indexes as Grove writes them: no leading zero.
            ("d-0-pre-01-abcde", None),
            ("d-0-pd-01-p-0-abcde", None),
            ("d-0-pd-1-p-x-abcde", None),
            ("d-0-pd-p-0-abcde", None),
            ("d-1-pre-0-abcde", None),
            ("e-0-pre-0-abcde", None),
            ("d-0-pre-0-ABCDE", None),
            ("d-0-frontend-0-abcde", None),
            ("pod", None),
            ("", None),
        ] {
            assert_eq!(of(pod), want, "{pod}");
        }
        // What Grove names from the composed names maps back, with the
        // group replica.
        let pclq = group_podclique_name("d", 0, "pd", 7, "dec");
        let pod = pod_name(&pclq, 2).replace('x', "q");
        let p = pod_of(&spec, &pod).unwrap();
        assert_eq!((p.service.name.as_str(), p.group_replica), ("dec", Some(7)));
        let p = pod_of(&spec, "d-0-pre-0-a1b2c").unwrap();
        assert_eq!(p.group_replica, None);
    }

    #[test]
    fn a_pod_two_services_could_name_is_nobodys() {
        // Member `a` of group `g`, replica 5, and the standalone `g-5-a`
        // compose the same PodClique name.
        let spec = DeploymentSpec::parse(
            r#"
version: 1
name: d
services:
  a: {role: decode, worker: {engine: mocker, model: m}}
  g-5-a: {role: decode, worker: {engine: mocker, model: m}}
groups:
  g: {services: [a], replicas: 1}
"#,
        )
        .unwrap();
        assert!(pod_of(&spec, "d-0-g-5-a-0-abcde").is_none());
        assert_eq!(
            pod_of(&spec, "d-0-g-4-a-0-abcde").map(|p| p.service.name.as_str()),
            Some("a")
        );
    }
}
