"""Not an Alembic environment: see ``env.py``."""
