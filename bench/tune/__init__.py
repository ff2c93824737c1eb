"""Config tuners: each times one kernel family under a grid of launch configs and checks each config against the float32 reference (GPU only)."""
