-- 0016_deployment_policy: the deployment's policy as the workers loaded it: their [defaults] (with their
-- QCONSOLE_<FIELD> variables) and their [queues.<name>] layers, each with its reason. job_type_contracts
-- holds a type's contract in its own queue only, and a producer without a policy file of its own (another
-- service, a script run from another directory) resolved everything else from the built-in defaults: a job
-- sent to another queue missed that queue's layer, and one of a type it imports missed the deployment's
-- defaults. Such a producer now reads them here. One row: the policy of the last worker to start.
CREATE TABLE deployment_policy (
    singleton    boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    defaults     jsonb NOT NULL,
    queues       jsonb NOT NULL,
    source       text NOT NULL,
    reported_by  text NOT NULL,
    reported_at  timestamptz NOT NULL
);
COMMENT ON TABLE deployment_policy IS
    'The policy file (defaults and queue layers) of the last worker to start, for producers without one.';
