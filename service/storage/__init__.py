"""Storage: SQLAlchemy tables, queries (functions of a Session) and Alembic migrations.

Must not import fastapi.
"""
