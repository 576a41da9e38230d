use super::*;

#[test]
fn stable_hash_is_stable() {
    assert_eq!(stable_hash(b""), "cbf29ce484222325");
    assert_ne!(stable_hash(b"a"), stable_hash(b"b"));
}
