"""HTTP handlers only: parse, call the pipeline or a query, respond. The only users of fastapi."""
