"""What every stage shares: paths and ports, the local servers, MLflow tracking, Prefect
artifacts, atomic files and stage outputs. Imports no stage folder."""
