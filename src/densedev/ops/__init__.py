"""Operations: metrics, the HTTP endpoints and logging."""
