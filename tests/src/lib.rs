//! Helpers for gpu-stack's end-to-end tests.
