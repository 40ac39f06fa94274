//! Hostile clients and descriptor exhaustion.
