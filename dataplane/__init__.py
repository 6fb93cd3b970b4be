"""dataplane: catalog (SQLite / PostgreSQL), Arrow heavy-field store, metadata-only planner,
streaming loader. (Comes with the data-plane issue.)"""
