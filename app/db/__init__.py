"""The app database: SQLAlchemy 2.0 models, engine/session helpers, API keys."""
