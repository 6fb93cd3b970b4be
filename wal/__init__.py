"""wal: token-granular write-ahead log — record format, segments, group commit, recovery, gRPC log
service; also the per-sandbox environment log. (Comes with the WAL issue.)"""
