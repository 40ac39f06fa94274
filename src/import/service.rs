//! The v0.1.x model: a guest cluster's `Service` of type `LoadBalancer`
//! and that cluster's `Node`s, as the old cloud provider turned them into a
//! load balancer. Listeners come from `spec.ports` (`port` → `nodePort`),
//! backends from every node's `InternalIP`, the VIP from
//! `status.loadBalancer.ingress`, the health check from the
//! `cloudprovider.harvesterhci.io/healthcheck-*` annotations (whose port
//! names a service port, translated to its nodePort as the cloud provider
//! did) or, for `externalTrafficPolicy: Local`, an HTTP check of
//! `healthCheckNodePort`; `sessionAffinity` and `loadBalancerSourceRanges`
//! carry over.

use std::net::IpAddr;

use super::common::{self, Parts};
use super::documents::Object;
use super::fields::{At, Reason, ip};
use super::model::{Check, Lb};
use super::{Accepts, Mapped};

/// The cloud provider's annotation prefix.
const PREFIX: &str = "cloudprovider.harvesterhci.io/";
/// Kubernetes' label that keeps a node out of every load balancer.
pub const EXCLUDE_LABEL: &str = "node.kubernetes.io/exclude-from-external-load-balancers";
/// kubectl's older way to write `loadBalancerSourceRanges`.
const SOURCE_RANGES_ANNOTATION: &str = "service.beta.kubernetes.io/load-balancer-source-ranges";

/// Whether `obj` is a `Service` of type `LoadBalancer` (other Services are
/// not load balancers and are only counted).
pub fn is_load_balancer(obj: &Object) -> bool {
    obj.value["spec"]["type"].as_str() == Some("LoadBalancer")
}

/// Why a node gives no backend.
pub enum NoBackend {
    /// As Kubernetes would have it (excluded, no address yet): a note.
    Normal(Reason),
    /// A field that cannot be read: the node is skipped, named.
    Bad(Reason),
}

/// The `InternalIP`s of a node, or why it gives none.
pub fn node_addresses(obj: &Object) -> Result<Vec<IpAddr>, NoBackend> {
    let root = At::root(&obj.value);
    let excluded = root
        .get("metadata")
        .get("labels")
        .map_entry(EXCLUDE_LABEL)
        .map_err(NoBackend::Bad)?;
    if excluded.is_some() {
        return Err(NoBackend::Normal(format!(
            "labelled {EXCLUDE_LABEL}: not a backend, as Kubernetes' service controller leaves it out"
        )));
    }
    let mut out = Vec::new();
    (|| {
        for a in root.get("status").get("addresses").each()? {
            if a.get("type").str()? == Some("InternalIP")
                && let Some(text) = a.get("address").str()?
            {
                out.push(ip(text, &format!("{}.address", a.path()))?);
            }
        }
        Ok(())
    })()
    .map_err(NoBackend::Bad)?;
    if out.is_empty() {
        return Err(NoBackend::Normal(
            "status.addresses has no InternalIP: not a backend".into(),
        ));
    }
    Ok(out)
}

/// Maps one `Service` of type `LoadBalancer` of `cluster` with the nodes'
/// addresses as its backends.
pub fn map(
    obj: &Object,
    cluster: &str,
    nodes: &[IpAddr],
    accepts: &Accepts,
) -> Result<Mapped, Reason> {
    let root = At::root(&obj.value);
    let meta = root.get("metadata");
    let annotations = meta.get("annotations");
    let spec = root.get("spec");
    let mut parts = Parts::default();
    let name = common::lb_name(&meta)?;
    let ipam = match annotations.map_entry(&format!("{PREFIX}ipam"))? {
        None | Some("") | Some("pool") => "pool",
        Some("dhcp") => "dhcp",
        Some(other) => {
            return Err(format!(
                "annotation {PREFIX}ipam: {other:?} is not an IPAM mode (pool or dhcp)"
            ));
        }
    };
    let vip = ingress_ip(&root.get("status").get("loadBalancer").get("ingress"))?;

    // spec.ports: listeners, and the port -> nodePort table the
    // healthcheck-port annotation is translated with.
    let mut listeners = Vec::new();
    let mut node_ports: Vec<(u16, u16)> = Vec::new();
    for p in spec.get("ports").each()? {
        let built = (|| {
            let port = p.get("port").port()?;
            let node_port = p.get("nodePort").port()?;
            if let (Some(port), Some(node_port)) = (port, node_port) {
                node_ports.push((port, node_port));
            }
            common::listener(
                p.path(),
                p.get("name").str()?,
                port,
                p.get("protocol").str()?,
                node_port,
                accepts,
            )
        })();
        match built {
            Ok(l) => listeners.push(l),
            Err(reason) => parts.skipped.push(reason),
        }
    }

    let thresholds = [
        annotation_count(&annotations, "healthcheck-success-threshold")?,
        annotation_count(&annotations, "healthcheck-failure-threshold")?,
        annotation_count(&annotations, "healthcheck-periodseconds")?,
        annotation_count(&annotations, "healthcheck-timeoutseconds")?,
    ];
    let local = spec.get("externalTrafficPolicy").str()? == Some("Local");
    let health_node_port = spec.get("healthCheckNodePort").port()?;
    let health_check = match (local, health_node_port) {
        (true, Some(port)) => {
            parts.notes.push(format!(
                "externalTrafficPolicy: Local: an HTTP check of healthCheckNodePort {port} (a node without a ready endpoint answers 503 and gets no traffic)"
            ));
            Some(Check::with_defaults("http", Some(port), thresholds))
        }
        _ => match annotations.map_entry(&format!("{PREFIX}healthcheck-port"))? {
            None => None,
            Some(text) => {
                let port = translate_health_port(text, &node_ports)?;
                common::check_with_port(
                    "tcp",
                    port,
                    &format!("annotation {PREFIX}healthcheck-port"),
                    thresholds,
                    accepts,
                    &mut parts,
                )
            }
        },
    };

    let client_ip_affinity = spec.get("sessionAffinity").str()? == Some("ClientIP");
    let affinity_timeout_seconds = if client_ip_affinity {
        spec.get("sessionAffinityConfig")
            .get("clientIP")
            .get("timeoutSeconds")
            .positive()?
    } else {
        None
    };
    let ranges_field = spec.get("loadBalancerSourceRanges");
    let mut source_ranges = common::source_ranges(&ranges_field)?;
    if source_ranges.is_empty()
        && let Some(text) = annotations.map_entry(SOURCE_RANGES_ANNOTATION)?
    {
        let list: Vec<serde_json::Value> = text
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| serde_json::Value::String(s.to_string()))
            .collect();
        let value = serde_json::json!({ SOURCE_RANGES_ANNOTATION: list });
        source_ranges = common::source_ranges(&At::root(&value).get(SOURCE_RANGES_ANNOTATION))?;
    }

    Ok(Mapped {
        lb: Lb {
            name,
            cluster: cluster.to_string(),
            vip,
            ipam,
            backends: nodes.to_vec(),
            listeners,
            health_check,
            client_ip_affinity,
            affinity_timeout_seconds,
            source_ranges,
            network: None,
            leased: false,
            forwarding: Default::default(),
        },
        skipped_parts: parts.skipped,
        notes: parts.notes,
        claim: None,
    })
}

/// The first `ip` of `status.loadBalancer.ingress[]`.
fn ingress_ip(at: &At<'_>) -> Result<IpAddr, Reason> {
    for item in at.each()? {
        let field = item.get("ip");
        if let Some(text) = field.str()?.filter(|s| !s.trim().is_empty()) {
            let addr = ip(text, field.path())?;
            if !addr.is_unspecified() {
                return Ok(addr);
            }
        }
    }
    Err("no address yet: status.loadBalancer.ingress has no ip".into())
}

/// An integer annotation (annotations are strings); 0 or absent is `None`.
fn annotation_count(annotations: &At<'_>, name: &str) -> Result<Option<u32>, Reason> {
    let key = format!("{PREFIX}{name}");
    match annotations.map_entry(&key)? {
        None => Ok(None),
        Some(text) => match text.trim().parse::<u32>() {
            Ok(0) => Ok(None),
            Ok(n) => Ok(Some(n)),
            Err(_) => Err(format!(
                "annotation {key}: {text:?} is not a positive integer"
            )),
        },
    }
}

/// `healthcheck-port` names a service port, probed at its nodePort on the
/// nodes; a number that already is one of the service's nodePorts is kept.
fn translate_health_port(text: &str, node_ports: &[(u16, u16)]) -> Result<Option<u16>, Reason> {
    let key = format!("{PREFIX}healthcheck-port");
    let n: u32 = text
        .trim()
        .parse()
        .map_err(|_| format!("annotation {key}: {text:?} is not a port number"))?;
    if n == 0 {
        return Ok(None);
    }
    if let Some(&(_, node_port)) = node_ports.iter().find(|(p, _)| u32::from(*p) == n) {
        return Ok(Some(node_port));
    }
    if node_ports.iter().any(|(_, np)| u32::from(*np) == n) {
        return Ok(Some(n as u16));
    }
    let ports: Vec<String> = node_ports.iter().map(|(p, _)| p.to_string()).collect();
    Err(format!(
        "annotation {key}: {n} is no port of the service (its ports: {}); the cloud provider probed a service port's nodePort",
        if ports.is_empty() {
            "none with a nodePort".to_string()
        } else {
            ports.join(", ")
        }
    ))
}
