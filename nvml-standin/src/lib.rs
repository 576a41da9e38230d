//! A stand-in libnvidia-ml for tests.
