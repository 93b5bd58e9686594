-- A bulk redrive's outcome is read by its request id (the canary, the final summary, `rdq stats --redrive`).
CREATE INDEX redrives_by_request ON redrives (request_id) WHERE request_id IS NOT NULL;
