//! Examples of embedding gpu-stack; see the `examples/*.rs` programs in this package.
