"""Protocol-free HTTP infrastructure every plane shares: request context (service, caller key, bounded
body reading, pydantic errors naming the field), API keys and actor tokens, body and connection limits,
the access log, Prometheus metrics, and the public wording of refusals. Nothing here knows a protocol."""
