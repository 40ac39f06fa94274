//! Transfers: node death mid-transfer, integrity under concurrency.
