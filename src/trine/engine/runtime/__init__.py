"""Where an engine runs: its worker thread, the in-process backend and Ray replicas."""
