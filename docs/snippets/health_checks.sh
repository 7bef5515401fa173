RAY_health_check_period_ms=1000 RAY_health_check_timeout_ms=2000 RAY_health_check_failure_threshold=5 ray start --head --port=6379
