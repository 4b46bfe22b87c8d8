"""The Airflow-level fault run: ``python -m chaos --airflow`` (real scheduler, dag-processor, api-server).

:mod:`chaos.airflow.run` starts a deployment (:mod:`demo.deployment`) with the DAGs of ``dags/``, runs a
nemesis against its task processes, workers, scheduler and store, and collects the history;
:mod:`chaos.airflow.check` checks it.
"""
