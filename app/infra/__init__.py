"""The infrastructure every role runs on, in one package that imports no role.

- `kafka`: the one place Kafka clients are configured (kafka-python producers and consumers, the
  aiokafka and Faust producer options)
- `event_producer`: the asyncio (aiokafka) producer of the ingest API and the replicas
- `kafka_net`: kafka-python's blocking calls, bounded
- `broker`: the embedded single-node Kafka broker (`LocalKafka`, `ensure_topics`, the jars)
- `mlflow_server`: the embedded MLflow tracking and registry server
- `procs`: stopping a child process and everything it started
- `wait`: waiting for a dependency, the same way in every role

May import: app.contracts, app.db, app.settings
Tests: tests/integration/test_kafka_broker.py, tests/unit/test_kafka_net.py, tests/unit/infra/
Docs: docs/OPERATIONS.md
"""
