"""GPU kernels of the stage worker, each beside the plain reference that is both its test oracle and the CPU path."""
