use super::*;

/// The fingerprint leaves out where objects were found (the same
/// objects in another order give the same file) and keeps what and
/// why; the header it is written into gives it back.
#[test]
fn skips_fingerprint_ignores_places_and_is_read_back() {
    let skip = |object: &str, reason: &str| Skip {
        object: object.to_string(),
        reason: reason.to_string(),
    };
    let here = [skip(
        "v1 ConfigMap ns/a (in-0, document 1, item 2)",
        "held by v1beta1 LoadBalancer ns/b (in-1, document 3) (the newcomer)",
    )];
    let there = [skip(
        "v1 ConfigMap ns/a (in-2, document 4)",
        "held by v1beta1 LoadBalancer ns/b (in-0, document 1, item 9) (the newcomer)",
    )];
    let other = [skip(
        "v1 ConfigMap ns/a (in-2, document 4)",
        "held by v1beta1 LoadBalancer ns/c (in-0, document 1, item 9) (the newcomer)",
    )];
    let print = skips_fingerprint(&here).expect("a fingerprint");
    assert_eq!(skips_fingerprint(&there).as_deref(), Some(print.as_str()));
    assert_ne!(skips_fingerprint(&other).as_deref(), Some(print.as_str()));
    assert_eq!(skips_fingerprint(&[]), None);
    let header = format!(
        "# Generated\n# 1 load balancer from 2 objects; 1 skipped (named on stderr by the import that found them; skips {print}).\n# Do not edit\n"
    );
    assert_eq!(header_skips(&header), Some(print.as_str()));
    assert_eq!(
        header_skips("# Generated\n# 1 load balancer; 0 skipped.\n"),
        None
    );
}
