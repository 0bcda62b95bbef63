"""The hybrid cache: per-token attention records, KDA state sizes (the packed-row planner and block pool come with the engine)."""
