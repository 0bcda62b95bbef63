"""The hybrid cache: record sizes, the cache format, the packed row plan, the pool and its
views, the row allocator and the prefix cache."""
