"""The ledger's tables: :data:`SCHEMA`, the statements that create them (and add the columns later versions
added, so an older ledger file gains them and keeps its rows), and :data:`STEP_TABLES`, those whose rows belong to a
training step. The :class:`~tasks.records.ledger.store.Ledger` (tasks/records/ledger/store.py) runs the schema when it
opens a file to write, and writes and asks the tables.
"""

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id VARCHAR PRIMARY KEY, started_at TIMESTAMP DEFAULT now(), finished_at TIMESTAMP,
    status VARCHAR, mlflow_run_id VARCHAR, config JSON, summary JSON);
CREATE TABLE IF NOT EXISTS prompts (
    prompt_id VARCHAR PRIMARY KEY, source VARCHAR, split VARCHAR, question VARCHAR, answer VARCHAR,
    solution VARCHAR, level INTEGER, reward VARCHAR, meta JSON, first_run_id VARCHAR,
    ingested_at TIMESTAMP DEFAULT now());
CREATE TABLE IF NOT EXISTS quarantine (
    run_id VARCHAR, source VARCHAR, line INTEGER, reason VARCHAR, raw VARCHAR, logged_at TIMESTAMP DEFAULT now());
CREATE TABLE IF NOT EXISTS ingests (
    run_id VARCHAR, source VARCHAR, rows INTEGER, accepted INTEGER, duplicates INTEGER, quarantined INTEGER,
    new INTEGER, logged_at TIMESTAMP DEFAULT now());
CREATE TABLE IF NOT EXISTS reference (
    run_id VARCHAR, round INTEGER, step INTEGER, prompt_id VARCHAR, n INTEGER, successes INTEGER,
    success_rate DOUBLE, predicted DOUBLE);
CREATE TABLE IF NOT EXISTS features (
    run_id VARCHAR, prompt_id VARCHAR, prompt_tokens INTEGER, level INTEGER, cot_tokens INTEGER,
    angle_intra DOUBLE, angle_inter DOUBLE, angle_score DOUBLE);
CREATE TABLE IF NOT EXISTS selections (
    run_id VARCHAR, round INTEGER, step INTEGER, prompt_id VARCHAR, selector VARCHAR, weight DOUBLE,
    pred_success DOUBLE, angle_score DOUBLE, gain_rank INTEGER, des DOUBLE, des_difficulty DOUBLE,
    des_cot DOUBLE, des_adaptability DOUBLE);
CREATE TABLE IF NOT EXISTS groups (
    run_id VARCHAR, step INTEGER, prompt_id VARCHAR, n INTEGER, successes INTEGER, mean_reward DOUBLE,
    kept INTEGER, kept_mean_reward DOUBLE, replayed BOOLEAN, from_step INTEGER);
CREATE TABLE IF NOT EXISTS stages (
    run_id VARCHAR, stage VARCHAR, wall_s DOUBLE, device VARCHAR, device_hours DOUBLE, cost DOUBLE,
    logged_at TIMESTAMP DEFAULT now());
CREATE TABLE IF NOT EXISTS evals (
    run_id VARCHAR, phase VARCHAR, step INTEGER, grp VARCHAR, n INTEGER, greedy_acc DOUBLE, avg_at_k DOUBLE);
ALTER TABLE evals ADD COLUMN IF NOT EXISTS pass_at_k DOUBLE;
ALTER TABLE selections ADD COLUMN IF NOT EXISTS screen_success DOUBLE;
ALTER TABLE groups ADD COLUMN IF NOT EXISTS policy_version INTEGER;
ALTER TABLE groups ADD COLUMN IF NOT EXISTS lag INTEGER;
CREATE TABLE IF NOT EXISTS skipped_updates (
    run_id VARCHAR, step INTEGER, minibatch INTEGER, cause VARCHAR, detail VARCHAR, site VARCHAR);
ALTER TABLE runs ADD COLUMN IF NOT EXISTS pid INTEGER;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS host VARCHAR;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS process_started DOUBLE;
"""

#: Tables whose rows belong to a training step (removed past a checkpoint on resume).
STEP_TABLES = ("reference", "selections", "groups", "skipped_updates")
