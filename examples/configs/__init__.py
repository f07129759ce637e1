"""Training configurations shipped with tilegraph (TOML)."""
