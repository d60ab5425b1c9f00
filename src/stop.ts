import pg from 'pg'

const PgQuery = (pg as any).Query

/** On a query already sent: how to cancel it, once it is the one Postgres is running. */
export const CANCEL_WHEN_RUNNING = Symbol('cancel when running')

/** The parts of pg's Client this module reads. */
interface ClientState {
  _queryQueue: unknown[]
  _activeQuery: unknown
  connection: unknown
}

/**
 * Runs a query (through `run`, the Client's own query path) so that an AbortSignal or a timeout
 * stops it. Not yet sent, it leaves the queue and never reaches Postgres. Sent, it is cancelled on
 * the server (`cancel`) once it is the statement running, not before: a query queued behind others
 * in a pipeline must not cancel theirs. Either way its callback (or promise) gets the reason, as
 * `fetch` rejects with the signal's, once Postgres has answered, so the connection stays usable.
 */
export function stoppableQuery(client: ClientState, run: (query: unknown) => void, cancel: () => void, args: any[], signal?: AbortSignal, timeout?: number) {
  let [config, values, callback] = args
  if (typeof values === 'function') [callback, values] = [values, undefined]
  const text = typeof config === 'string' ? config : { ...config, signal: undefined, query_timeout: undefined }
  const query = new PgQuery(text, values)
  let done: ((err: unknown, res?: unknown) => void) | undefined = callback ?? config?.callback
  const result = done ? undefined : new Promise((resolve, reject) => (done = (err, res) => (err ? reject(err) : resolve(res))))
  let reason: unknown
  const stop = (why: unknown) => {
    if (reason !== undefined) return
    reason = why
    const queued = client._queryQueue.indexOf(query)
    if (queued >= 0) {
      client._queryQueue.splice(queued, 1)
      query.handleError(reason, client.connection)
    } else if (client._activeQuery === query) cancel()
    else query[CANCEL_WHEN_RUNNING] = cancel
  }
  const onAbort = () => stop(signal!.reason)
  const timer = timeout ? setTimeout(() => stop(new Error('Query read timeout')), timeout) : undefined
  query.callback = (err: unknown, res: unknown) => {
    clearTimeout(timer)
    signal?.removeEventListener('abort', onAbort)
    reason === undefined ? done!(err, res) : done!(reason)
  }
  if (signal?.aborted) query.callback(signal.reason) // never sent
  else {
    signal?.addEventListener('abort', onAbort)
    run(query)
  }
  return result
}

/** A query object pg's Client runs by calling its handlers (pg-cursor, pg-query-stream). */
interface Submittable {
  handleError(err: unknown, connection: unknown): void
  handleReadyForQuery(connection: unknown): void
  /** pg-cursor's read under way (pg-query-stream's through its `cursor`). */
  _cb?: unknown
  cursor?: { _cb?: unknown }
}

/** Whether Postgres may be running the Submittable's statement: a cursor with no read under way has its portal suspended. */
const mayRun = (query: Submittable) => {
  const cursor = query.cursor ?? query
  return !('_cb' in cursor) || Boolean(cursor._cb)
}

/**
 * pg's `query_timeout` on a Submittable, as pg has it: when the time is up it fails with 'Query read
 * timeout', at once. edgepg also cancels the statement on the server if it may be running (pg leaves
 * it running, and the connection waits for it), and keeps Postgres's answer to that cancel from the
 * Submittable, which has already synced.
 */
export function timeSubmittable(client: ClientState, query: Submittable, cancel: () => void, timeout: number) {
  const { handleError, handleReadyForQuery } = query
  let timedOut = false
  const timer = setTimeout(() => {
    timedOut = true
    const queued = client._queryQueue.indexOf(query)
    if (queued >= 0) client._queryQueue.splice(queued, 1)
    else if (client._activeQuery === query && mayRun(query)) cancel()
    handleError.call(query, new Error('Query read timeout'), client.connection)
  }, timeout)
  query.handleError = function (err, connection) {
    if (timedOut) return
    clearTimeout(timer)
    handleError.call(this, err, connection)
  }
  query.handleReadyForQuery = function (connection) {
    clearTimeout(timer)
    handleReadyForQuery.call(this, connection)
  }
}
