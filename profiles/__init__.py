"""Hardware and cluster profiles as TOML, installed as package data.

Each number names its source next to it. `measured/` holds profiles written by
`meshplan profile` on real machines.
"""
