use super::*;

#[test]
fn masks_become_prefix_lengths_and_a_non_contiguous_one_is_named() {
    for (mask, v6, len) in [
        ("255.255.255.0", false, 24),
        ("255.255.0.0", false, 16),
        ("255.255.255.252", false, 30),
        ("0.0.0.0", false, 0),
        ("255.255.255.255", false, 32),
        ("24", false, 24),
        ("/20", false, 20),
        // An IPv4 mask held in 16 bytes.
        ("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ff00", false, 24),
        // An IPv6 subnet's, as Go prints a 16-byte mask.
        ("ffff:ffff:ffff:ffff::", true, 64),
        ("ffff:ffff:ffff:ffff:ffff:ffff:ffff:fff0", true, 124),
        ("64", true, 64),
        ("120", true, 120),
    ] {
        assert_eq!(prefix_of_mask(mask, "m", v6), Ok(len), "{mask}");
    }
    let e = prefix_of_mask("255.0.255.0", "status.allocatedAddress.mask", false).unwrap_err();
    assert!(
        e.starts_with(
            "status.allocatedAddress.mask: \"255.0.255.0\" is not a contiguous subnet mask"
        ),
        "{e}"
    );
    assert!(prefix_of_mask("255.255.255.1", "m", false).is_err());
    assert!(
        prefix_of_mask("33", "m", false)
            .unwrap_err()
            .contains("0-32")
    );
    assert!(
        prefix_of_mask("129", "m", true)
            .unwrap_err()
            .contains("0-128")
    );
    assert!(
        prefix_of_mask("255.255.255.0", "m", true)
            .unwrap_err()
            .contains("is an IPv4 subnet mask, and the gateway is IPv6")
    );
    assert!(
        prefix_of_mask("ffff:ffff:ffff:ffff::", "m", false)
            .unwrap_err()
            .contains("is an IPv6 subnet mask, and the gateway is IPv4")
    );
    assert!(
        prefix_of_mask("banana", "m", false)
            .unwrap_err()
            .contains("not a subnet mask")
    );
}

#[test]
fn a_bridge_keepalived_would_read_specially_is_refused_by_name() {
    let at = |bridge: &str| {
        serde_json::json!({
            "config": serde_json::json!({"type": "bridge", "bridge": bridge}).to_string()
        })
    };
    let fine = at("mgmt-br");
    assert!(bridge_config(&At::root(&fine).get("config")).is_ok());
    for bad in ["br#1", "br!1", "br$1", "br{1", "br\"1"] {
        let v = at(bad);
        let e = bridge_config(&At::root(&v).get("config")).unwrap_err();
        assert!(e.contains("keepalived.conf"), "{bad}: {e}");
    }
}

#[test]
fn a_vlan_device_name_is_derived_where_it_fits() {
    let f = |bridge: &str, vlan| NadFacts {
        bridge: bridge.into(),
        vlan,
        l3: None,
    };
    assert_eq!(
        f("mgmt-br", Some(100)).interface("n").unwrap(),
        "mgmt-br.100"
    );
    assert_eq!(f("data-br", None).interface("n").unwrap(), "data-br");
    let e = f("storage-net-br", Some(2011))
        .interface("default/s")
        .unwrap_err();
    assert!(
        e.contains("\"storage-net-br.2011\"")
            && e.contains("--network-interface default/s=INTERFACE"),
        "{e}"
    );
}

#[test]
fn the_mapping_flag_is_parsed_and_bad_values_are_named() {
    let m = parse_mapping(&["default/vlan100=eth1.100".into(), " a/b = br0 ".into()]).unwrap();
    assert_eq!(m["default/vlan100"], "eth1.100");
    assert_eq!(m["a/b"], "br0");
    assert!(
        parse_mapping(&["default/vlan100".into()])
            .unwrap_err()
            .to_string()
            .contains("NETWORK=INTERFACE")
    );
    assert!(
        parse_mapping(&["=eth0".into()])
            .unwrap_err()
            .to_string()
            .contains("no network name")
    );
    assert!(
        parse_mapping(&["a/b=eth/0".into()])
            .unwrap_err()
            .to_string()
            .contains("interface name")
    );
    assert!(
        parse_mapping(&["a/b=x".into(), "a/b=y".into()])
            .unwrap_err()
            .to_string()
            .contains("twice")
    );
}
