"""Allocation: what a container gets for its devices (env, device nodes, CDI, device-info)."""
