"""The doctor's rules, one module per area; each ``check_*`` reads a Probe and returns findings."""
