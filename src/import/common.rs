//! What the `LoadBalancer` versions and the guest `Service` model share: the
//! load balancer's name and cluster, IPAM, the VIP, node addresses,
//! listeners and the health check, each read with its field path so a
//! skip line names the field.

use std::net::IpAddr;

use super::documents::Object;
use super::fields::{At, Reason, ip, show};
use super::model::{Check, DEFAULT_CLUSTER, Lb, Listener};
use super::{Accepts, Mapped, network};

/// The annotation Harvester's load-balancer controller reads the owning
/// guest cluster from.
pub const CLUSTER_ANNOTATION: &str = "loadbalancer.harvesterhci.io/cluster";
/// The label the cloud provider puts on the load balancers it creates.
pub const CLUSTER_LABEL: &str = "cloudprovider.harvesterhci.io/cluster";

/// Where one `LoadBalancer` version keeps what differs between versions.
pub struct Layout {
    /// The VIP.
    pub vip: &'static [&'static str],
    /// Where else a VIP may be (the other version's place, or the address
    /// a DHCP lease gave).
    pub vip_fallback: &'static [&'static str],
    /// The node addresses.
    pub backends: &'static [&'static str],
    /// The names of the health check's period field, first found wins.
    pub period: &'static [&'static str],
}

fn at_path<'a>(root: &At<'a>, keys: &[&str]) -> At<'a> {
    keys.iter().fold(root.clone(), |at, key| at.get(key))
}

/// Maps a `LoadBalancer` object laid out as `layout` says.
pub fn map_load_balancer(
    obj: &Object,
    accepts: &Accepts,
    layout: &Layout,
) -> Result<Mapped, Reason> {
    let root = At::root(&obj.value);
    let meta = root.get("metadata");
    let spec = root.get("spec");
    let mut mapped_parts = Parts::default();
    let name = lb_name(&meta)?;
    let cluster = lb_cluster(&meta)?;
    let ipam = ipam(&spec.get("ipam"))?;
    let claim = network::claim(&meta, &root.get("status").get("allocatedAddress"))?;
    // A DHCP VIP on a network is leased by this daemon: no address yet is
    // no reason to wait (the one Harvester wrote, if any, is asked for).
    let leased = ipam == "dhcp" && claim.is_some();
    let (primary, fallback) = (
        at_path(&root, layout.vip),
        at_path(&root, layout.vip_fallback),
    );
    let vip = match vip_opt(&primary, &fallback)? {
        Some(ip) => ip,
        None if leased => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        None => return Err(no_vip(&primary, &fallback)?),
    };
    let backends = addresses(&at_path(&root, layout.backends))?;
    let listeners = listeners(&spec.get("listeners"), accepts, &mut mapped_parts)?;
    let hc = spec.get("healthCheck");
    let period = layout
        .period
        .iter()
        .map(|k| hc.get(k))
        .find(At::is_present)
        .unwrap_or_else(|| hc.get(layout.period[0]));
    let thresholds = [
        hc.get("successThreshold").positive()?,
        hc.get("failureThreshold").positive()?,
        period.positive()?,
        hc.get("timeoutSeconds").positive()?,
    ];
    let health_check = if hc.is_present() {
        let port = hc.get("port").port()?;
        check_with_port(
            "tcp",
            port,
            hc.path(),
            thresholds,
            accepts,
            &mut mapped_parts,
        )
    } else {
        None
    };
    Ok(Mapped {
        lb: Lb {
            name,
            cluster,
            vip,
            ipam,
            backends,
            listeners,
            health_check,
            client_ip_affinity: false,
            affinity_timeout_seconds: None,
            forwarding: Default::default(),
            source_ranges: Vec::new(),
            network: claim.as_ref().map(|c| c.name.clone()),
            leased,
        },
        skipped_parts: mapped_parts.skipped,
        notes: mapped_parts.notes,
        claim,
    })
}

/// What was left out of an object that was still imported, and what was
/// mapped in a way worth saying.
#[derive(Default)]
pub struct Parts {
    /// Parts not imported (a listener of a protocol we do not serve):
    /// errors under `--strict`.
    pub skipped: Vec<Reason>,
    /// Informational: how something was mapped.
    pub notes: Vec<Reason>,
}

/// `<namespace>/<name>` from `metadata`.
pub fn lb_name(meta: &At<'_>) -> Result<String, Reason> {
    let name = meta.get("name").str()?.filter(|s| !s.is_empty());
    let namespace = meta.get("namespace").str()?.filter(|s| !s.is_empty());
    // Kubernetes' own limits: a namespace is a DNS label, a name a DNS
    // subdomain; an API server stores nothing longer.
    for (field, value, max) in [("namespace", namespace, 63), ("name", name, 253)] {
        if let Some(v) = value.filter(|v| v.len() > max) {
            return Err(format!(
                "metadata.{field} is {} bytes long; Kubernetes allows at most {max}",
                v.len()
            ));
        }
    }
    match (namespace, name) {
        (Some(ns), Some(name)) => Ok(format!("{ns}/{name}")),
        (None, _) => Err(
            "metadata.namespace is missing: the load balancer's name is <namespace>/<name>".into(),
        ),
        (_, None) => Err("metadata.name is missing".into()),
    }
}

/// The owning cluster: the controller's annotation, else the cloud
/// provider's label, else `kubernetes`.
pub fn lb_cluster(meta: &At<'_>) -> Result<String, Reason> {
    let annotation = meta.get("annotations").map_entry(CLUSTER_ANNOTATION)?;
    let label = meta.get("labels").map_entry(CLUSTER_LABEL)?;
    Ok(annotation
        .or(label)
        .filter(|s| !s.is_empty())
        .unwrap_or(DEFAULT_CLUSTER)
        .to_string())
}

/// `pool` (also when absent) or `dhcp`.
pub fn ipam(at: &At<'_>) -> Result<&'static str, Reason> {
    match at.str()? {
        None | Some("") | Some("pool") => Ok("pool"),
        Some("dhcp") => Ok("dhcp"),
        Some(other) => Err(format!(
            "{}: {other:?} is not an IPAM mode (pool or dhcp)",
            at.path()
        )),
    }
}

/// The VIP from `primary`, or from `fallback` when `primary` is empty or
/// the unspecified address Harvester writes for a DHCP VIP; `None` when
/// neither has one yet.
pub fn vip_opt(primary: &At<'_>, fallback: &At<'_>) -> Result<Option<IpAddr>, Reason> {
    let first = primary.str()?.map(str::trim).filter(|s| !s.is_empty());
    let first_ip = first.map(|s| ip(s, primary.path())).transpose()?;
    if let Some(ip) = first_ip.filter(|ip| !ip.is_unspecified()) {
        return Ok(Some(ip));
    }
    let second = fallback.str()?.map(str::trim).filter(|s| !s.is_empty());
    Ok(second
        .map(|s| ip(s, fallback.path()))
        .transpose()?
        .filter(|ip| !ip.is_unspecified()))
}

/// Why there is no VIP yet (once [`vip_opt`] found none).
fn no_vip(primary: &At<'_>, fallback: &At<'_>) -> Result<Reason, Reason> {
    let first = primary.str()?.map(str::trim).filter(|s| !s.is_empty());
    let first_ip = first.map(|s| ip(s, primary.path())).transpose()?;
    Ok(match first_ip {
        Some(unspecified) => format!(
            "no VIP yet: {} is {unspecified} (a DHCP address not leased yet) and {} is empty",
            primary.path(),
            fallback.path()
        ),
        None => format!(
            "no allocated address yet: {} and {} are empty",
            primary.path(),
            fallback.path()
        ),
    })
}

/// A list of node addresses.
pub fn addresses(at: &At<'_>) -> Result<Vec<IpAddr>, Reason> {
    at.strings()?
        .iter()
        .enumerate()
        .map(|(i, s)| ip(s, &format!("{}[{i}]", at.path())))
        .collect()
}

/// Listeners of `spec.listeners[]` (`name`, `port`, `protocol`,
/// `backendPort`); one that cannot be served is left out and said.
pub fn listeners(
    at: &At<'_>,
    accepts: &Accepts,
    parts: &mut Parts,
) -> Result<Vec<Listener>, Reason> {
    let mut out = Vec::new();
    for item in at.each()? {
        let built = (|| {
            let port = item.get("port").port()?;
            let backend_port = item.get("backendPort").port()?;
            let protocol = item.get("protocol").str()?;
            let name = item.get("name").str()?;
            listener(item.path(), name, port, protocol, backend_port, accepts)
        })();
        match built {
            Ok(l) => out.push(l),
            Err(reason) => parts.skipped.push(reason),
        }
    }
    Ok(out)
}

/// One listener, or why it cannot be served.
pub fn listener(
    path: &str,
    name: Option<&str>,
    port: Option<u16>,
    protocol: Option<&str>,
    backend_port: Option<u16>,
    accepts: &Accepts,
) -> Result<Listener, Reason> {
    let shown = name.filter(|n| !n.is_empty()).unwrap_or("(unnamed)");
    let protocol = match protocol.unwrap_or("TCP") {
        "" | "TCP" | "tcp" => "tcp",
        "UDP" | "udp" if accepts.udp => "udp",
        "UDP" | "udp" => {
            return Err(format!(
                "listener {path} ({shown}): protocol UDP is not served by this harvester-lb (its config accepts TCP listeners only); left out"
            ));
        }
        other => {
            return Err(format!(
                "listener {path} ({shown}): protocol {other:?} is not served (TCP{} only); left out",
                if accepts.udp { " and UDP" } else { "" }
            ));
        }
    };
    let Some(port) = port else {
        return Err(format!("listener {path} ({shown}): no port; left out"));
    };
    let Some(backend_port) = backend_port else {
        return Err(format!(
            "listener {path} ({shown}): no backend port (nodePort) allocated; left out"
        ));
    };
    let name = match name.filter(|n| !n.is_empty()) {
        Some(n) => n.to_string(),
        // A Service with one port may leave it unnamed.
        None => format!("{protocol}-{port}"),
    };
    Ok(Listener {
        port,
        protocol,
        name,
        backend_port,
    })
}

/// A check of `port`, or, without a port, a check without one where the
/// config accepts that (else no check, as Harvester runs none then).
pub fn check_with_port(
    kind: &'static str,
    port: Option<u16>,
    what: &str,
    thresholds: [Option<u32>; 4],
    accepts: &Accepts,
    parts: &mut Parts,
) -> Option<Check> {
    match port {
        Some(port) => Some(Check::with_defaults(kind, Some(port), thresholds)),
        None if accepts.check_without_port => {
            parts.notes.push(format!(
                "{what}: the port is 0 or absent: the health check is written without a port (the config's default applies)"
            ));
            Some(Check::with_defaults(kind, None, thresholds))
        }
        None => {
            parts.notes.push(format!(
                "{what}: the port is 0 or absent: imported without a health check (Harvester runs none then; every backend is always eligible)"
            ));
            None
        }
    }
}

/// `loadBalancerSourceRanges`: CIDRs, host bits cleared (Kubernetes takes
/// `10.0.0.1/8` as `10.0.0.0/8`; the config insists on the network form).
pub fn source_ranges(at: &At<'_>) -> Result<Vec<ipnet::IpNet>, Reason> {
    at.strings()?
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.trim()
                .parse::<ipnet::IpNet>()
                .map(|n| n.trunc())
                .map_err(|_| {
                    format!(
                        "{}[{i}]: {} is not a CIDR (ADDRESS/PREFIX)",
                        at.path(),
                        show(&serde_json::Value::String(s.to_string()))
                    )
                })
        })
        .collect()
}
