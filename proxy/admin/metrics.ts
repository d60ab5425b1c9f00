/**
 * Prometheus metrics for one edgepg-proxy, served at GET /metrics.
 *
 * Each proxy has its own registry (not prom-client's global one), so several proxies in one
 * process (tests, or an app embedding more than one) never clash over metric names. The registry
 * also carries prom-client's default process metrics (CPU, memory, event-loop lag, GC, handles),
 * under their usual unprefixed names so stock dashboards work.
 *
 * Nothing here ever sees a password or a message payload: sessions are counted from their
 * `SessionLog` (peer, upstream, duration, byte counts, outcome), and only a small fixed set of
 * label values is ever used, so the number of series stays bounded whatever clients send.
 */
import type { IncomingMessage, ServerResponse } from 'node:http'
import { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } from 'prom-client'

/**
 * How a session ended, as a bounded code (the metrics' label):
 * - `ok`: closed by the client or by Postgres in the ordinary way
 * - `client_error`: the client broke the rules (a text frame, a WebSocket error)
 * - `upstream_unreachable`: the TCP connection to Postgres could not be made
 * - `upstream_error`: the connection to Postgres failed after it was made
 * - `refused_by_postgres`: Postgres refused the startup (wrong password, no such database, …)
 * - `startup_refused`: the proxy refused the startup (malformed, insecure password, TLS failure, …)
 * - `timeout`: a time limit ended the session (the handshake or the idle timeout)
 * - `over_budget`: closed with 1009, a message not fitting in `--max-client-buffer`
 * - `cancel_dropped`: a CancelRequest not sent on (a key the proxy never issued, or over `--max-cancels-per-ip`)
 * - `shutdown`: the proxy closed the session while shutting down
 * - `token_expired`: the token the session logged in with expired (proxy/auth/tokens.ts)
 * - `token_refused`: the proxy refused the login's token (its signature, claims or role; no password for the role)
 */
export const OUTCOME_KINDS = [
  'ok',
  'client_error',
  'upstream_unreachable',
  'upstream_error',
  'refused_by_postgres',
  'startup_refused',
  'timeout',
  'over_budget',
  'cancel_dropped',
  'shutdown',
  'token_expired',
  'token_refused',
  'idle_in_transaction',
  'over_share',
] as const
export type OutcomeKind = (typeof OUTCOME_KINDS)[number]

/** What the metrics read of an ended session (proxy/ws/session.ts's SessionLog). */
export interface SessionRecord {
  bytesIn: number
  bytesOut: number
  kind: OutcomeKind
  authFailed: boolean
}
import type { PoolEvent } from '../pool/backends'
import type { LendingMetrics } from '../pool/lender'
import type { KeyBackends } from '../pool/lenders'
import { FALLBACKS, type ReplicaEvents } from '../replicas/replicas'

/**
 * Why an HTTP upgrade (a would-be session) was refused before any WebSocket opened:
 * - `not_found`: no WebSocket route at that path (404)
 * - `bad_address`: `?address=` is not a valid `host:port` (400)
 * - `forbidden_address`: `?address=` is not the upstream nor in the allow-list (403)
 * - `origin`: the request's Origin is not allowed (403)
 * - `too_many_sessions`: the proxy's session limit is reached
 * - `too_many_sessions_per_ip`: the peer's own session limit is reached
 * - `shutting_down`: the proxy is closing and takes no new sessions
 * - `other`: anything else (also what an unknown reason is counted as)
 */
export const REFUSAL_REASONS = [
  'not_found',
  'bad_address',
  'forbidden_address',
  'origin',
  'too_many_sessions',
  'too_many_sessions_per_ip',
  'shutting_down',
  'other',
] as const
export type RefusalReason = (typeof REFUSAL_REASONS)[number]

export interface Metrics {
  /** This proxy's own registry (default process metrics included). */
  readonly registry: Registry
  /** A WebSocket session was accepted (call once per session, when it opens). */
  sessionOpened(): void
  /** A session ended; call once with its log entry (bytes are counted here). */
  sessionClosed(log: SessionRecord): void
  /** The TCP connection to Postgres was made, `seconds` after it was started. */
  upstreamConnected(seconds: number): void
  /** An upgrade was refused before a WebSocket opened. */
  refused(reason: RefusalReason): void
  /** The backend pool handed out a warm backend, missed, reset one or closed one. */
  poolEvent(event: PoolEvent): void
  /** Transaction pooling: what the lenders do (see proxy/pool/lender.ts). */
  readonly lending: LendingMetrics
  /** Reads on replicas (see proxy/replicas/replicas.ts). */
  readonly replicas: ReplicaEvents
  /** Serves the Prometheus exposition (GET or HEAD; 405 otherwise). */
  handle(req: IncomingMessage, res: ServerResponse): Promise<void>
}

const PREFIX = 'edgepg_proxy_'
/** 0 (at once) to the default --pool-timeout. */
const WAIT_BUCKETS = [0.0001, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5]
/** 0.5 ms (same host) to 5 s (a connect timeout in the making). */
export const CONNECT_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5]

/** What the proxy holds right now, read when metrics are served. */
export interface Load {
  pool: { pooled: number; idle: number }
  logins: { running: number; waiting: number }
  /** Bytes held (or declared) by clients' unfinished messages and /sql bodies. */
  buffered: number
  /** Transaction pooling: backends lent now and sessions waiting for one, and backends per upstream, user and database. */
  lending: { lent: number; waiting: number; listening: number }
  keys: KeyBackends[]
}

const NO_LOAD: Load = { pool: { pooled: 0, idle: 0 }, logins: { running: 0, waiting: 0 }, buffered: 0, lending: { lent: 0, waiting: 0, listening: 0 }, keys: [] }

/** `source`: the text /metrics serves, when not this registry's alone (a worker's: the whole proxy's, proxy/cluster/). */
export function createMetrics(load: () => Load = () => NO_LOAD, source?: () => Promise<string>): Metrics {
  const registry = new Registry()
  collectDefaultMetrics({ register: registry })
  const registers = [registry]

  const active = new Gauge({ name: `${PREFIX}sessions_active`, help: 'WebSocket sessions open now', registers })
  const sessions = new Counter({
    name: `${PREFIX}sessions_total`,
    help: 'Sessions ended, by how they ended',
    labelNames: ['outcome_kind'] as const,
    registers,
  })
  const received = new Counter({ name: `${PREFIX}bytes_received_total`, help: 'Bytes received from clients (counted when a session ends)', registers })
  const sent = new Counter({ name: `${PREFIX}bytes_sent_total`, help: 'Bytes sent to clients (counted when a session ends)', registers })
  const authFailures = new Counter({
    name: `${PREFIX}auth_failures_total`,
    help: 'Sessions refused for failed authentication (SQLSTATE class 28 from Postgres, with auth offload)',
    registers,
  })
  const connect = new Histogram({
    name: `${PREFIX}upstream_connect_seconds`,
    help: 'Time to open the TCP connection to Postgres',
    buckets: CONNECT_BUCKETS,
    registers,
  })
  const refusals = new Counter({
    name: `${PREFIX}upgrades_refused_total`,
    help: 'WebSocket upgrades refused before a session opened, by reason',
    labelNames: ['reason'] as const,
    registers,
  })
  new Gauge({ name: `${PREFIX}pool_backends`, help: 'Backends the pool owns (idle or lent to a session)', registers, collect() { this.set(load().pool.pooled) } })
  new Gauge({ name: `${PREFIX}pool_idle_backends`, help: 'Pooled backends waiting for a session', registers, collect() { this.set(load().pool.idle) } })
  new Gauge({ name: `${PREFIX}logins_at_postgres`, help: 'Logins connected to Postgres and not yet accepted (bounded by --max-logins)', registers, collect() { this.set(load().logins.running) } })
  new Gauge({ name: `${PREFIX}logins_waiting`, help: 'Logins waiting for a place under --max-logins or --max-logins-per-ip', registers, collect() { this.set(load().logins.waiting) } })
  new Gauge({ name: `${PREFIX}client_buffer_bytes`, help: "Bytes clients' unfinished messages and /sql bodies hold or have declared (bounded by --max-client-buffer)", registers, collect() { this.set(load().buffered) } })
  const poolEvents = {
    hit: new Counter({ name: `${PREFIX}pool_hits_total`, help: 'Sessions served by a warm backend (no fork, no authentication at Postgres)', registers }),
    miss: new Counter({ name: `${PREFIX}pool_misses_total`, help: 'Poolable logins that found no warm backend and went to Postgres', registers }),
    reset: new Counter({ name: `${PREFIX}pool_resets_total`, help: 'Backends reset and kept when their session ended', registers }),
    renew: new Counter({ name: `${PREFIX}pool_renewals_total`, help: "Backends logged in ahead of need to replace a key's last one before its lifetime ended (--pool-keep-warm)", registers }),
    discard: new Counter({ name: `${PREFIX}pool_discards_total`, help: 'Pooled backends closed (busy or broken at the end of a session, failed reset or ping, idle timeout, lifetime, limits)', registers }),
  }
  // Counted on every statement of transaction pooling: kept in plain numbers, handed to prom-client as it is scraped.
  const counted = { lends: 0, reset: 0, refused: 0 }
  new Counter({ name: `${PREFIX}lends_total`, help: 'Transaction pooling: backends lent to sessions', registers, collect() { this.inc(counted.lends), (counted.lends = 0) } })
  // Waits for a backend, one per statement of transaction pooling: observed into prom-client a few thousand at a time
  // (in a loop, observe costs a small part of what it costs once per statement on that path) and at every scrape.
  const waited = new Float64Array(4096)
  let pending = 0
  const observeWaits = () => {
    for (let i = 0; i < pending; i++) waits.observe(waited[i])
    pending = 0
  }
  const waits = new Histogram({ name: `${PREFIX}lend_wait_seconds`, help: 'Transaction pooling: how long a session waited for a backend', buckets: WAIT_BUCKETS, registers, collect: observeWaits })
  const timeouts = new Counter({ name: `${PREFIX}lend_timeouts_total`, help: 'Transaction pooling: sessions that waited past --pool-timeout (SQLSTATE 53300)', registers })
  const pins = new Counter({ name: `${PREFIX}pinned_sessions_total`, help: 'Transaction pooling: sessions that came to keep their backend, by what its verification found first (unseen: set what no catalog shows)', labelNames: ['reason'] as const, registers })
  const verifications = new Counter({ name: `${PREFIX}verifications_total`, help: 'Transaction pooling: backends asked what a transaction that did more than plain reads and writes left on them (the session keeps its backend while it holds any)', registers })
  new Counter({
    name: `${PREFIX}handovers_total`,
    help: 'Transaction pooling: backends that changed hands, reset (DISCARD ALL) in the next session\'s first write; refused: Postgres refused the reset, the backend was closed and the messages sent elsewhere',
    labelNames: ['outcome'] as const,
    registers,
    collect() {
      for (const outcome of ['reset', 'refused'] as const) this.inc({ outcome }, counted[outcome]), (counted[outcome] = 0)
    },
  })
  const preparedAgain = new Counter({ name: `${PREFIX}statements_prepared_again_total`, help: 'Transaction pooling: named statements prepared again on another backend', registers })
  const moves = new Counter({ name: `${PREFIX}backend_moves_total`, help: 'Transaction pooling with --workers: backends handed to another worker, whose sessions waited for one', registers })
  new Gauge({ name: `${PREFIX}lent_backends`, help: 'Transaction pooling: backends lent to sessions now (pinned ones included)', registers, collect() { this.set(load().lending.lent) } })
  new Gauge({ name: `${PREFIX}listening_sessions`, help: 'Transaction pooling: sessions listening on channels through the proxy\'s listening backends (one per user and database)', registers, collect() { this.set(load().lending.listening) } })
  new Gauge({ name: `${PREFIX}lend_waiting`, help: 'Transaction pooling: sessions and /sql requests waiting for a backend now', registers, collect() { this.set(load().lending.waiting) } })
  new Gauge({
    name: `${PREFIX}key_backends`,
    help: 'Transaction pooling: backends per upstream, user and database, idle or lent',
    labelNames: ['upstream', 'user', 'database', 'state'] as const,
    registers,
    collect() {
      this.reset()
      for (const { upstream, user, database, idle, lent } of load().keys) {
        this.inc({ upstream, user, database, state: 'idle' }, idle)
        this.inc({ upstream, user, database, state: 'lent' }, lent)
      }
    },
  })
  const targets = new Counter({ name: `${PREFIX}transactions_total`, help: 'Transaction pooling with --replica: transactions (a lend each) by where they ran: primary, replica', labelNames: ['target'] as const, registers })
  const replicaWaits = new Histogram({ name: `${PREFIX}replica_wait_seconds`, help: 'Reads that waited for a replica to replay what their session had seen, and how long (--replica-wait)', buckets: WAIT_BUCKETS, registers })
  const fallbacks = new Counter({ name: `${PREFIX}replica_fallbacks_total`, help: 'Reads meant for a replica that ran on the primary, by why: none_usable, down, refused (the standby refused this login: its options, role or database), lag (--replica-max-lag), read_only (the standby refused a write, 25006), position (not replayed within --replica-wait), promoted, check_failed (the standby refused the session\'s check: serializable by default)', labelNames: ['reason'] as const, registers })
  const checks = new Counter({ name: `${PREFIX}replica_checks_total`, help: 'Checks asked of replicas (one ahead of each read, and one each time a read waiting for a position asks again)', registers })
  const lag = new Gauge({ name: `${PREFIX}replica_lag_seconds`, help: "Each replica's replay lag, as its last check said", labelNames: ['replica'] as const, aggregator: 'max', registers })
  const up = new Gauge({ name: `${PREFIX}replica_up`, help: 'Whether each replica serves reads (1) or is passed over (0: down, refused a login, promoted, another cluster)', labelNames: ['replica'] as const, aggregator: 'min', registers })
  // Every series exists from the start, at 0, so rate() and alerts work before the first event.
  for (const target of ['primary', 'replica']) targets.inc({ target }, 0)
  for (const reason of FALLBACKS) fallbacks.inc({ reason }, 0)
  for (const kind of OUTCOME_KINDS) sessions.inc({ outcome_kind: kind }, 0)
  for (const reason of REFUSAL_REASONS) refusals.inc({ reason }, 0)

  return {
    registry,
    sessionOpened: () => active.inc(),
    sessionClosed(log) {
      active.dec()
      sessions.inc({ outcome_kind: log.kind })
      if (log.bytesIn > 0) received.inc(log.bytesIn)
      if (log.bytesOut > 0) sent.inc(log.bytesOut)
      if (log.authFailed) authFailures.inc()
    },
    upstreamConnected(seconds) {
      if (Number.isFinite(seconds) && seconds >= 0) connect.observe(seconds)
    },
    poolEvent: (event) => poolEvents[event].inc(),
    lending: {
      lent(seconds) {
        counted.lends++
        waited[pending++] = seconds
        if (pending === waited.length) observeWaits()
      },
      timedOut: () => timeouts.inc(),
      pinned: (reason) => pins.inc({ reason }),
      verified: () => verifications.inc(),
      handedOver: (outcome) => void counted[outcome]++,
      preparedAgain: () => preparedAgain.inc(),
      moved: () => moves.inc(),
    },
    replicas: {
      routed: (target) => targets.inc({ target }),
      waited: (seconds) => replicaWaits.observe(seconds),
      fellBack: (reason) => fallbacks.inc({ reason }),
      checked: () => checks.inc(),
      observed(replica, seconds, serves) {
        lag.set({ replica }, seconds)
        up.set({ replica }, serves ? 1 : 0)
      },
    },
    refused(reason) {
      refusals.inc({ reason: (REFUSAL_REASONS as readonly string[]).includes(reason) ? reason : 'other' })
    },
    async handle(req, res) {
      if (req.method !== 'GET' && req.method !== 'HEAD') {
        res.writeHead(405, { allow: 'GET, HEAD', 'content-type': 'text/plain' })
        res.end('method not allowed\n')
        return
      }
      try {
        const body = await (source ?? (() => registry.metrics()))()
        res.writeHead(200, { 'content-type': registry.contentType, 'cache-control': 'no-store' })
        res.end(req.method === 'HEAD' ? undefined : body)
      } catch (err) {
        res.writeHead(500, { 'content-type': 'text/plain' })
        res.end(`edgepg-proxy: metrics unavailable: ${(err as Error).message}\n`)
      }
    },
  }
}
