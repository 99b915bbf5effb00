"""The local test bed: a real control plane on loopback with a fake GPU node pool (test and demo machinery)."""
