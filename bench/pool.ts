/**
 * Section "pool" (`npx tsx bench/run.ts pool`): issue 21's four workloads, each beside what it is
 * measured against, through edgepg-proxy children (test/support/child-proxy.ts) run with POOL_PROXY_FLAGS:
 * 1. many sessions: SESSIONS at once, a statement every 2 s for 20 s, on a role limited to 60
 *    Postgres connections; against pg over TCP through PgBouncer (Debian's 1.18, transaction mode);
 * 2. busy sessions: 64 sessions back to back (a read by id, `SELECT $1::int`), TRANSACTION_MODE_FLAGS against session mode,
 *    a bare transaction pooler (bench/ws-pool-floor.ts, the floor) and wsproxy → PgBouncer, unsafe and safe (DISCARD ALL after each transaction): queries/s, proxy, Postgres and client CPU per
 *    statement, and the rate the three allow on the machine's cores;
 * 3. POST /sql at 32 in flight, against bench/http-pg.ts (a bare HTTP server on pg.Pool);
 * 4. memory: the proxy's RSS per idle logged-in session;
 * 5. bursts: 1,500 and 5,000 sessions each running a statement and a named insert three times over
 *    ~8 s, on edgepg-proxy with its default --workers, run after run, against PgBouncer.
 * Cases 1, 3 and 4 run edgepg-proxy with TRANSACTION_MODE_FLAGS; case 2 sets them beside session mode.
 * Cases 1, 1b and 2 also run edgepg Clients through Neon's wsproxy in front of PgBouncer (bench/neon-pair.ts)
 * when both are here: the shape of Neon's "-pooler" endpoints.
 */
import { readFileSync } from 'node:fs'
import { availableParallelism } from 'node:os'
import { setTimeout as sleep } from 'node:timers/promises'
import pg from 'pg'
import { WebSocket } from 'ws'
import { Client, type ClientConfig } from '../src/index'
import { procStat, startChildProxy, startGcProxy } from '../test/support/child-proxy'
import { pgbouncerBinary, startPgBouncer } from '../test/support/pgbouncer'
import { PASSWORD, startPostgres, type PgInfo } from '../test/support/stack'
import { cpuBetween, gc, interleave, median, percentile, printGrid, treeCpu, treeCpuSeconds, type BenchContext, type Row, type Section } from './lib'
import { startHttpPg, startWsPoolFloor, startWsRelay } from './proxy'
import { leanPoster } from './http'
import { NEON_PAIR, neonPairMissing, scramSecrets, startNeonPair } from './neon-pair'

const NOFILE = Number(/^Max open files\s+(\d+)/m.exec(readFileSync('/proc/self/limits', 'utf8'))?.[1] ?? 1024)
/** Descriptors kept in each process for everything but the sessions' sockets. */
const FD_SPARE = 256
const WANTED_SESSIONS = Number(process.env.EDGEPG_BENCH_POOL_SESSIONS ?? 5000)
if (!Number.isInteger(WANTED_SESSIONS) || WANTED_SESSIONS < 1) throw new Error(`EDGEPG_BENCH_POOL_SESSIONS must be a positive integer, got ${process.env.EDGEPG_BENCH_POOL_SESSIONS}`)
/** Case 1's sessions. The proxy child inherits this process's limit and holds two sockets a session while it logs in. */
const SESSIONS = Math.min(WANTED_SESSIONS, Math.floor((NOFILE - FD_SPARE) / 2))
const IDLE_SESSIONS = 1000
/** The cases to run (EDGEPG_BENCH_POOL_CASES, comma-separated; all by default). */
const CASES = new Set((process.env.EDGEPG_BENCH_POOL_CASES ?? '1,1b,2,3,4,5').split(','))

/** The flags that put edgepg-proxy in transaction mode, with PgBouncer's pool size. */
export const TRANSACTION_MODE_FLAGS: string[] = ['--pool-mode', 'transaction', '--pool-size', '20']
/** Room for every session of this section from 127.0.0.1, and no wait on shutdown. */
const ROOM_FLAGS = ['--max-sessions', String(Math.max(SESSIONS, IDLE_SESSIONS) + 100), '--max-sessions-per-ip', String(Math.max(SESSIONS, IDLE_SESSIONS) + 100), '--shutdown-grace', '0']
/** edgepg-proxy's flags for cases 1, 3 and 4, and for case 2's transaction-mode side. */
export const POOL_PROXY_FLAGS = [...ROOM_FLAGS, ...TRANSACTION_MODE_FLAGS]
/** Case 2's other side. */
const SESSION_MODE_FLAGS = [...ROOM_FLAGS, '--pool-mode', 'session']
const MODE = TRANSACTION_MODE_FLAGS.join(' ')

const ROLE = 'bench_pool'
const ROLE_PASSWORD = 'bench-pool-pw'
const ROLE_LIMIT = 60
const BOUNCER_POOL = 20
const CORES = availableParallelism()
const ITEMS = 1000
const READ = 'SELECT v FROM bench_pool_items WHERE id = $1'
const INSERT = 'INSERT INTO bench_pool_scratch (session) VALUES ($1)'

type Op = 'read' | 'prepared' | 'transaction'
/** One session's 20 s, a step every TICK_MS: the named statement 3 times (parsed once, then bound by name), 2 transactions. */
const SCHEDULE: Op[] = ['prepared', 'read', 'transaction', 'read', 'prepared', 'read', 'read', 'transaction', 'read', 'prepared']
const TICK_MS = 2000
/** Logins under way at once: under PgBouncer's listen backlog (128), so no SYN waits a second for a retry. */
const CONNECTING = 100
const CONNECT_TIMEOUT_MS = 30_000
const QUERY_TIMEOUT_MS = 10_000
const SAMPLE_MS = 200

const BUSY_SESSIONS = 64
const BUSY_ROUNDS = 4
const BUSY_MS = 2000
/** Transaction mode's queries/s, at least this share of session mode's (the issue). */
const BUSY_SHARE_TARGET = 0.9

const SQL_IN_FLIGHT = 32
const SQL_ROUNDS = 3
const SQL_REQUESTS = 4000
const SQL_WARMUP = 500

const SETTLE_MS = 2000
const MiB = 1 << 20

export const pool: Section = {
  name: 'pool',
  async run(ctx) {
    const admin = superuser(ctx.pg)
    await admin.connect()
    const started = performance.now()
    const rows: Row[] = []
    try {
      await createRole(admin)
      if (['1', '1b', '2'].some((c) => CASES.has(c)) && neonPairMissing()) console.log(neonPairMissing())
      if (CASES.has('1')) await manySessions(ctx, admin)
      if (CASES.has('1b')) await latencyFloors(ctx, admin)
      if (CASES.has('2')) rows.push(...(await busySessions(ctx, admin)))
      if (CASES.has('3')) await sqlInFlight(ctx)
      if (CASES.has('4')) await idleMemory()
      if (CASES.has('5')) await bursts(ctx, admin)
    } finally {
      await dropRole(admin).catch((err) => console.error(`pool: could not drop ${ROLE}:`, err))
      await admin.end().catch(() => {})
    }
    console.log(`\npool: the section took ${((performance.now() - started) / 1000).toFixed(0)} s.`)
    return rows
  },
}

const superuser = (db: PgInfo) => new pg.Client({ host: db.host, port: db.port, database: db.database, user: 'postgres', password: PASSWORD })

async function createRole(admin: pg.Client) {
  // Not a superuser: Postgres does not hold superusers to a CONNECTION LIMIT.
  await admin.query(`SET password_encryption = 'scram-sha-256'`)
  await admin.query(`CREATE ROLE ${ROLE} LOGIN NOSUPERUSER PASSWORD '${ROLE_PASSWORD}' CONNECTION LIMIT ${ROLE_LIMIT}`)
  await admin.query(`CREATE TABLE bench_pool_items (id int PRIMARY KEY, v text NOT NULL)`)
  await admin.query(`INSERT INTO bench_pool_items SELECT i, md5(i::text) FROM generate_series(1, ${ITEMS}) i`)
  await admin.query(`CREATE TABLE bench_pool_scratch (session int NOT NULL, at timestamptz NOT NULL DEFAULT now())`)
  await admin.query(`GRANT SELECT ON bench_pool_items TO ${ROLE}`)
  await admin.query(`GRANT INSERT ON bench_pool_scratch TO ${ROLE}`)
}

async function dropRole(admin: pg.Client) {
  await waitForNoBackends(admin)
  await admin.query(`DROP TABLE IF EXISTS bench_pool_items, bench_pool_scratch`)
  await admin.query(`DROP ROLE IF EXISTS ${ROLE}`)
}

const roleBackends = async (admin: pg.Client) =>
  (await admin.query(`SELECT count(*)::int AS n FROM pg_stat_activity WHERE usename = $1 AND backend_type = 'client backend'`, [ROLE])).rows[0].n as number

/** The role's backends gone (a stopped proxy's or PgBouncer's close as Postgres notices), so the next case starts from none. */
async function waitForNoBackends(admin: pg.Client) {
  for (const deadline = Date.now() + 10_000; (await roleBackends(admin)) > 0 && Date.now() < deadline; ) await sleep(100)
}

// ---- 1. many sessions ----

interface Load {
  connected: number
  failedLogins: Map<string, number>
  failedQueries: Map<string, number>
  latencies: number[]
  peakBackends: number
  /** From the first login to the last one's answer. */
  loginSeconds: number
  seconds: number
  /** The proxy's or PgBouncer's CPU seconds until the last login answered, and from then to the schedule's end (before the sessions end). */
  cpu: { logins: number; after: number }
  /** Statements and transactions (each read and prepared one of its own, each BEGIN … COMMIT one) answered, errors included, in that second window. */
  after: { statements: number; transactions: number }
}

async function manySessions(ctx: BenchContext, admin: pg.Client) {
  const role = { host: ctx.pg.host, port: ctx.pg.port, database: ctx.pg.database, user: ROLE, password: ROLE_PASSWORD, query_timeout: QUERY_TIMEOUT_MS }
  const proxy = await startChildProxy(`${ctx.pg.host}:${ctx.pg.port}`, { built: true, flags: POOL_PROXY_FLAGS })
  let edge: Load
  try {
    edge = await sessionLoad(admin, () => new Client({ ...role, webSocketConstructor: WebSocket as any, wsProxy: () => proxy.url } as ClientConfig), () => treeCpuSeconds(proxy.pid))
  } finally {
    await proxy.stop()
  }
  await waitForNoBackends(admin)
  let bouncer: Load | undefined
  if (pgbouncerBinary()) {
    const b = await startBouncer(ctx.pg, admin)
    try {
      bouncer = await sessionLoad(admin, () => new pg.Client({ ...role, port: b.port }), () => treeCpuSeconds(process.pid, 'pgbouncer'))
    } finally {
      await b.stop()
    }
    await waitForNoBackends(admin)
  }
  let neon: Load | undefined
  if (!neonPairMissing()) {
    const n = await startNeonPair(ctx.pg, admin, [ROLE], { default_pool_size: BOUNCER_POOL, max_client_conn: SESSIONS + 100 })
    try {
      neon = await sessionLoad(admin, () => new Client(n.config(role)), n.cpu)
    } finally {
      await n.stop()
    }
    await waitForNoBackends(admin)
  }
  const cell = (f: (l: Load) => string) => [f(edge), bouncer ? f(bouncer) : 'not installed', neon ? f(neon) : 'skipped']
  const ratio = (f: (l: Load) => number) => [bouncer, neon].map((b) => (b ? `${(f(edge) / f(b)).toFixed(2)}x` : ''))
  const p = (l: Load, q: number) => percentile(l.latencies, q)
  const per = (l: Load, n: 'statements' | 'transactions') => (l.cpu.after * 1e6) / l.after[n]
  const capped = SESSIONS < WANTED_SESSIONS ? ` (${WANTED_SESSIONS} asked; open files allow ${SESSIONS})` : ''
  printGrid(
    `pool 1: ${SESSIONS} sessions at once, a statement every ${TICK_MS / 1000} s for ${(SCHEDULE.length * TICK_MS) / 1000} s, role limited to ${ROLE_LIMIT} connections`,
    ['metric', `edgepg-proxy (${MODE})`, `pg via PgBouncer 1.18 (transaction, pool ${BOUNCER_POOL})`, `${NEON_PAIR}`, 'ratio to PgBouncer', 'ratio to wsproxy → PgBouncer'],
    [
      ['sessions connected', ...cell((l) => `${l.connected} of ${SESSIONS}`), ...ratio((l) => l.connected)],
      ['failed logins, by SQLSTATE', ...cell((l) => counts(l.failedLogins)), ''],
      ['statements answered', ...cell((l) => String(l.latencies.length)), ...ratio((l) => l.latencies.length)],
      ['failed statements, by SQLSTATE', ...cell((l) => counts(l.failedQueries)), ''],
      [`peak backends of ${ROLE}`, ...cell((l) => String(l.peakBackends)), ''],
      ['statement latency p50 / p99', ...cell((l) => `${p(l, 50).toFixed(2)} / ${p(l, 99).toFixed(2)} ms`), ...ratio((l) => p(l, 50))],
      ['last login answered after', ...cell((l) => `${l.loginSeconds.toFixed(1)} s`), ...ratio((l) => l.loginSeconds)],
      ['wall time (logins, workload, ends)', ...cell((l) => `${l.seconds.toFixed(1)} s`), ''],
      ['proxy / PgBouncer CPU until the last login / after it', ...cell((l) => `${l.cpu.logins.toFixed(2)} / ${l.cpu.after.toFixed(2)} s`), ''],
      ['its CPU per session, until the last login', ...cell((l) => `${((l.cpu.logins * 1e6) / l.connected).toFixed(0)} µs`), ...ratio((l) => l.cpu.logins / l.connected)],
      ['its CPU per statement / per transaction, after it', ...cell((l) => `${per(l, 'statements').toFixed(0)} / ${per(l, 'transactions').toFixed(0)} µs`), ...ratio((l) => per(l, 'statements'))],
    ],
    [
      `Each session: connect (${CONNECTING} logins under way at once), then from a random moment in its first ${TICK_MS / 1000} s one step every ${TICK_MS / 1000} s: ` +
        `${SCHEDULE.join(', ')}. read = "${READ}" (unnamed); prepared = the same as pg's { name, text, values } (Parse the first time a client uses it, Bind by name after); ` +
        `transaction = BEGIN; INSERT into a scratch table; COMMIT (ROLLBACK on an error). All sessions end together after the last step. ` +
        `Latency is per statement; a statement not answered in ${QUERY_TIMEOUT_MS / 1000} s fails (pg's query_timeout).`,
      `Role ${ROLE}: not a superuser, SCRAM, CONNECTION LIMIT ${ROLE_LIMIT}. Backends sampled every ${SAMPLE_MS} ms from pg_stat_activity on a superuser connection opened before. ` +
        `edgepg-proxy: a child process with ${POOL_PROXY_FLAGS.join(' ')}` +
        (TRANSACTION_MODE_FLAGS.length
          ? '. '
          : `; in session mode each session holds a backend, so logins past the limit fail with 53300, each after a Postgres fork and SCRAM exchange ` +
            `(at most --max-logins-per-ip, default 8, at once from 127.0.0.1): its sessions' statements run while those go on. `) +
        `PgBouncer: transaction mode, default_pool_size ${BOUNCER_POOL}, max_client_conn ${SESSIONS + 100}, the role's SCRAM secret in its userlist; 1.18 keeps no protocol-level ` +
        `prepared statements across server connections, so named statements fail with 42P05 (the name exists on that backend already) and 26000 (not on this one); ` +
        `pg sends Parse again after a failed one, so once every server connection has the name, every use fails with 42P05. ` +
        `wsproxy → PgBouncer: the same PgBouncer, with Neon's Go relay (bench/neon-pair.ts) in front; edgepg Clients reach it by ws://…/v1?address=host:port and log in through it with SCRAM.`,
      `SESSIONS = ${SESSIONS}${capped}; set EDGEPG_BENCH_POOL_SESSIONS to lower it. Open files allowed (ulimit -n): ${NOFILE}; this process needs one per session, ` +
        `the proxy child up to two (a client and a Postgres socket), PgBouncer one per client.`,
      `CPU: user + system time of the proxy child and its descendants (/proc/<pid>/stat; EDGEPG_WORKERS=1 here, so one process), or of PgBouncer (with wsproxy: both), in 10 ms ticks: ` +
        `until the last login answered, then from there to the last step's answer (the sessions' ends left out), divided by the statements ` +
        `(answered or failed: PgBouncer's 42P05 and 26000 count) and transactions (each read and prepared statement one, each BEGIN … COMMIT one) answered in that second window.`,
    ]
  )
}

/** Every session of one side: logins, the schedule, then all end together. */
async function sessionLoad(admin: pg.Client, open: () => pg.Client, cpu: () => number): Promise<Load> {
  const load: Load = { connected: 0, failedLogins: new Map(), failedQueries: new Map(), latencies: [], peakBackends: 0, loginSeconds: 0, seconds: 0, cpu: { logins: 0, after: 0 }, after: { statements: 0, transactions: 0 } }
  const clients: pg.Client[] = []
  const done = { statements: 0, transactions: 0 }
  const timed = async (client: pg.Client, query: string | pg.QueryConfig) => {
    const t0 = performance.now()
    try {
      await client.query(query)
      load.latencies.push(performance.now() - t0)
    } catch (err) {
      count(load.failedQueries, err)
      throw err
    } finally {
      done.statements++
    }
  }
  const item = (i: number) => (i % ITEMS) + 1
  const ops: Record<Op, (c: pg.Client, i: number) => Promise<void>> = {
    read: (c, i) => timed(c, { text: READ, values: [item(i)] }),
    prepared: (c, i) => timed(c, { name: 'bench_pool_read', text: READ, values: [item(i)] }),
    async transaction(c, i) {
      try {
        await timed(c, 'BEGIN')
        await timed(c, { text: INSERT, values: [i] })
        await timed(c, 'COMMIT')
      } catch {
        await c.query('ROLLBACK').catch(() => {})
      }
    },
  }
  const connecting = slots(CONNECTING)
  let loggedIn = 0
  let mark = { cpu: cpu(), ...done }
  const t0 = performance.now()
  const session = async (i: number) => {
    const client = open()
    client.on('error', () => {})
    clients.push(client)
    try {
      await connecting(() => bounded(client.connect(), CONNECT_TIMEOUT_MS))
    } catch (err) {
      return count(load.failedLogins, err)
    } finally {
      load.loginSeconds = (performance.now() - t0) / 1000
      if (++loggedIn === SESSIONS) {
        const now = { cpu: cpu(), ...done }
        load.cpu.logins = now.cpu - mark.cpu
        mark = now
      }
    }
    load.connected++
    const first = performance.now() + Math.random() * TICK_MS
    for (const [t, op] of SCHEDULE.entries()) {
      await sleep(Math.max(0, first + t * TICK_MS - performance.now()))
      await ops[op](client, i).catch(() => {})
      done.transactions++
    }
  }
  const peak = sampleBackends(admin)
  try {
    await Promise.all(Array.from({ length: SESSIONS }, (_, i) => session(i)))
    load.cpu.after = cpu() - mark.cpu
    load.after = { statements: done.statements - mark.statements, transactions: done.transactions - mark.transactions }
  } finally {
    await Promise.all(clients.map((c) => bounded(c.end(), 5000).catch(() => {})))
    load.peakBackends = await peak()
  }
  load.seconds = (performance.now() - t0) / 1000
  return load
}

/** Samples the role's backends every SAMPLE_MS until the returned function is called, which resolves with the peak. */
function sampleBackends(admin: pg.Client): () => Promise<number> {
  let peak = 0
  let sampling = true
  const done = (async () => {
    for (; sampling; await sleep(SAMPLE_MS)) peak = Math.max(peak, await roleBackends(admin))
  })()
  return async () => {
    sampling = false
    await done
    return peak
  }
}

/** PgBouncer (test/support/pgbouncer.ts) with the limited role in its userlist by its SCRAM secret: with a plain-text password PgBouncer spends a PBKDF2 on every login. */
const startBouncer = async (db: PgInfo, admin: pg.Client) => startPgBouncer(db, { default_pool_size: BOUNCER_POOL, max_client_conn: SESSIONS + 100 }, await scramSecrets(admin, [ROLE]))

// ---- 1b. what one statement's latency is made of ----

const FLOOR_SESSIONS = 200
const FLOOR_TICK_MS = 100
const FLOOR_MS = 8000
/** The start of each path's window (its server just started), p99 over it too. */
const FRESH_MS = 2000
/** Then cold sessions (connect, one statement, end), this many at once for COLD_MS. */
const COLD_AT_ONCE = 16
const COLD_MS = 3000

/**
 * Case 1's statement at about its rate (2,000/s), from FLOOR_SESSIONS sessions of a role with no
 * connection limit, so that paths holding a backend per session can run it too: edgepg-proxy, the
 * bare WebSocket relay (the least any WebSocket path costs), PgBouncer, wsproxy → PgBouncer, and pg
 * straight to Postgres; then cold sessions, COLD_AT_ONCE at a time. Each path's server CPU from /proc.
 */
async function latencyFloors(ctx: BenchContext, admin: pg.Client) {
  const upstream = `${ctx.pg.host}:${ctx.pg.port}`
  const user = ctx.pgConfig().user!
  await admin.query(`GRANT SELECT ON bench_pool_items TO ${user}`)
  const overWs = (url: string) => () => new Client({ ...ctx.pgConfig(), webSocketConstructor: WebSocket as any, wsProxy: () => url } as ClientConfig)
  const bouncerSettings = { default_pool_size: BOUNCER_POOL, max_client_conn: FLOOR_SESSIONS + 100 }
  type Path = { name: string; start(): Promise<{ open(): pg.Client; stop(): Promise<void>; cpu?: () => number }> }
  const paths: Path[] = [
    { name: `edgepg-proxy (${MODE})`, start: async () => ((p) => ({ open: overWs(p.url), stop: p.stop, cpu: () => treeCpuSeconds(p.pid) }))(await startChildProxy(upstream, { built: true, flags: POOL_PROXY_FLAGS })) },
    { name: 'edgepg Client via bare WebSocket relay', start: async () => ((r) => ({ open: overWs(`ws://127.0.0.1:${r.port}/`), stop: r.stop, cpu: r.cpuSeconds }))(await startWsRelay(upstream)) },
    ...(pgbouncerBinary() ? [{ name: 'pg via PgBouncer 1.18 (transaction)', start: async () => ((b) => ({ open: () => new pg.Client({ ...ctx.pgConfig(), port: b.port }), stop: b.stop, cpu: () => treeCpuSeconds(b.pid) }))(await startPgBouncer(ctx.pg, bouncerSettings, await scramSecrets(admin, [user]))) }] : []),
    ...(neonPairMissing() ? [] : [{ name: NEON_PAIR, start: async () => ((n) => ({ open: () => new Client(n.config(ctx.pgConfig())), stop: n.stop, cpu: n.cpu }))(await startNeonPair(ctx.pg, admin, [user], bouncerSettings)) }]),
    { name: 'pg straight to Postgres', start: async () => ({ open: () => new pg.Client(ctx.pgConfig()), stop: async () => {} }) },
  ]
  const results: Array<{ name: string; latencies: number[]; fresh: number[]; cpu: { login: number; statement: number; cold: number }; cold: number; coldFailed: Map<string, number> }> = []
  for (const path of paths) {
    const { open, stop, cpu = () => NaN } = await path.start()
    const clients: pg.Client[] = []
    const r = { name: path.name, latencies: [] as number[], fresh: [] as number[], cpu: { login: 0, statement: 0, cold: 0 }, cold: 0, coldFailed: new Map<string, number>() }
    try {
      const connecting = slots(CONNECTING)
      let cpu0 = cpu()
      await Promise.all(Array.from({ length: FLOOR_SESSIONS }, () => connecting(async () => { const c = open(); clients.push(c); await c.connect() })))
      r.cpu.login = (cpu() - cpu0) / FLOOR_SESSIONS
      cpu0 = cpu()
      const start = performance.now()
      const end = start + FLOOR_MS
      await Promise.all(clients.map(async (c, s) => {
        await sleep(Math.random() * FLOOR_TICK_MS)
        for (let i = s; performance.now() < end; i += FLOOR_SESSIONS) {
          const t0 = performance.now()
          await c.query(READ, [(i % ITEMS) + 1])
          r.latencies.push(performance.now() - t0)
          if (t0 < start + FRESH_MS) r.fresh.push(performance.now() - t0)
          await sleep(FLOOR_TICK_MS)
        }
      }))
      r.cpu.statement = (cpu() - cpu0) / r.latencies.length
      await Promise.all(clients.splice(0).map((c) => bounded(c.end(), 5000).catch(() => {})))
      cpu0 = cpu()
      const coldStart = performance.now()
      await Promise.all(Array.from({ length: COLD_AT_ONCE }, async () => {
        while (performance.now() < coldStart + COLD_MS) {
          const c = open()
          c.on('error', () => {})
          await c.connect().then(() => c.query(READ, [1])).then(() => r.cold++, (err) => count(r.coldFailed, err))
          await bounded(c.end(), 5000).catch(() => {})
        }
      }))
      r.cpu.cold = (cpu() - cpu0) / r.cold
      r.cold /= (performance.now() - coldStart) / 1000
    } finally {
      await Promise.all(clients.map((c) => bounded(c.end(), 5000).catch(() => {})))
      await stop()
    }
    results.push(r)
  }
  const over = (name: string) => ((b) => (r: (typeof results)[0]) => (b ? `${(median(r.latencies) / median(b.latencies)).toFixed(2)}x` : ''))(results.find((r) => r.name.startsWith(name)))
  const [overBouncer, overNeon] = [over('pg via PgBouncer'), over(NEON_PAIR)]
  const µs = (seconds: number) => (Number.isNaN(seconds) ? '' : `${(seconds * 1e6).toFixed(0)} µs`)
  printGrid(
    `pool 1b: one statement's latency, ${FLOOR_SESSIONS} sessions, one statement each every ${FLOOR_TICK_MS} ms; then cold sessions, ${COLD_AT_ONCE} at a time`,
    ['path', 'statements', 'p50', 'p99', `p99, first ${FRESH_MS / 1000} s`, 'p50 over PgBouncer', 'p50 over wsproxy → PgBouncer', 'server CPU / statement', 'server CPU / login', 'cold sessions/s', 'server CPU / cold session'],
    results.map((r) => [
      r.name, String(r.latencies.length), `${median(r.latencies).toFixed(2)} ms`, `${percentile(r.latencies, 99).toFixed(2)} ms`, `${percentile(r.fresh, 99).toFixed(2)} ms`, overBouncer(r), overNeon(r),
      µs(r.cpu.statement), µs(r.cpu.login), `${Math.round(r.cold)}/s${r.coldFailed.size ? `, failed ${counts(r.coldFailed)}` : ''}`, µs(r.cpu.cold),
    ]),
    [
      `"${READ}" (unnamed), role ${user} (no connection limit: the relay and pg hold a backend per session). One path after another, each on a server started for it: ` +
        `${FLOOR_SESSIONS} logins (${CONNECTING} at once), ${FLOOR_MS / 1000} s of statements (p99 also over their first ${FRESH_MS / 1000} s), the sessions end, ` +
        `then for ${COLD_MS / 1000} s ${COLD_AT_ONCE} loops of connect, one statement, end. ` +
        `The bare WebSocket relay (bench/ws-relay.ts) passes bytes between a ws server and a Postgres socket and does nothing else: no Node WebSocket path can be faster. ` +
        `PgBouncer (both paths): transaction mode, default_pool_size ${BOUNCER_POOL}, ${user}'s SCRAM secret in its userlist; wsproxy: bench/neon-pair.ts. ` +
        `Client, relays and Postgres share this machine's ${availableParallelism()} cores.`,
      `Server CPU: user + system time (/proc/<pid>/stat, 10 ms ticks) of the proxy child and its descendants, the relay, PgBouncer, or wsproxy + PgBouncer (Postgres's own left out): ` +
        `over the logins per login, over the ${FLOOR_MS / 1000} s per statement, over the cold loops per cold session.`,
    ]
  )
}

// ---- 2. busy sessions ----

/** Case 2's paths: edgepg-proxy in each mode, and wsproxy → PgBouncer as Neon's "-pooler" runs it (unsafe) and with DISCARD ALL after every transaction (safe). */
type BusyPath = 'floor' | 'session' | 'transaction' | 'unsafe' | 'safe'
const BUSY_NAMES: Record<BusyPath, string> = {
  floor: 'bare transaction pooler (floor)',
  session: 'edgepg-proxy, session mode',
  transaction: `edgepg-proxy, ${MODE}`,
  unsafe: 'wsproxy → PgBouncer (transaction; unsafe)',
  safe: 'wsproxy → PgBouncer + server_reset_query_always (safe)',
}
/** Case 2's workloads, by name: its statement. */
const BUSY_WORKLOADS = { 'read by id': READ, 'SELECT $1::int': 'SELECT $1::int' }
type BusyWorkload = keyof typeof BUSY_WORKLOADS
/** Each path and workload once before the rounds: logins and pools' backends done, so no backend starts (or ends) in a window. */
const BUSY_WARM_MS = 500
type BusyMetric = 'queries/s' | 'proxy CPU / statement' | 'Postgres CPU / statement' | 'client CPU / statement'
/** Transaction mode's figure over another path's, and its target (issue 46; the first from issue 21): at least it for queries/s, at most it for CPU. */
const BUSY_RATIOS: Array<{ metric: BusyMetric; over: BusyPath; target: number }> = [
  { metric: 'queries/s', over: 'session', target: BUSY_SHARE_TARGET },
  { metric: 'queries/s', over: 'safe', target: 1.25 },
  { metric: 'queries/s', over: 'unsafe', target: 0.85 },
  { metric: 'Postgres CPU / statement', over: 'session', target: 1.3 },
  { metric: 'proxy CPU / statement', over: 'session', target: 1.2 },
]

async function busySessions(ctx: BenchContext, admin: pg.Client): Promise<Row[]> {
  const upstream = `${ctx.pg.host}:${ctx.pg.port}`
  const user = ctx.pgConfig().user!
  // Every backend is a child of the postmaster: the parent of this connection's.
  const postmaster = procStat((await admin.query('SELECT pg_backend_pid() AS pid')).rows[0].pid).ppid
  const bouncer = { default_pool_size: BOUNCER_POOL, max_client_conn: BUSY_SESSIONS + 100 }
  type Server = { config: ClientConfig; cpu(): number; stop(): Promise<void> }
  const edge = async (flags: string[]): Promise<Server> =>
    ((p) => ({ config: { ...ctx.pgConfig(), webSocketConstructor: WebSocket as any, wsProxy: () => p.url } as ClientConfig, cpu: () => treeCpuSeconds(p.pid), stop: p.stop }))(await startChildProxy(upstream, { built: true, flags }))
  const pair = async (settings: Record<string, number>): Promise<Server> =>
    ((n) => ({ config: n.config(ctx.pgConfig()), cpu: n.cpu, stop: n.stop }))(await startNeonPair(ctx.pg, admin, [user], { ...bouncer, ...settings }))
  const cfg = ctx.pgConfig()
  const starts: Record<BusyPath, () => Promise<Server>> = {
    floor: async () =>
      ((r) => ({ config: { ...cfg, webSocketConstructor: WebSocket as any, wsProxy: () => `ws://127.0.0.1:${r.port}/` } as ClientConfig, cpu: r.cpuSeconds, stop: r.stop }))(
        await startWsPoolFloor(`postgres://${encodeURIComponent(user)}:${encodeURIComponent(String(cfg.password))}@${cfg.host}:${cfg.port}/${cfg.database}`, BOUNCER_POOL)
      ),
    session: () => edge(SESSION_MODE_FLAGS),
    transaction: () => edge(POOL_PROXY_FLAGS),
    unsafe: () => pair({}),
    // server_reset_query (DISCARD ALL by default) after every transaction, not only when a client leaves.
    safe: () => pair({ server_reset_query_always: 1 }),
  }
  const paths = (Object.keys(starts) as BusyPath[]).filter((p) => !neonPairMissing() || (p !== 'unsafe' && p !== 'safe'))
  const workloads = Object.keys(BUSY_WORKLOADS) as BusyWorkload[]
  const servers: Partial<Record<BusyPath, Server>> = {}
  const clients: Partial<Record<BusyPath, pg.Client[]>> = {}
  type Totals = { queries: number; seconds: number; latencies: number[]; proxy: number; pg: number; client: number; started: number; ended: number }
  const totals = Object.fromEntries(paths.map((p) => [p, Object.fromEntries(workloads.map((w) => [w, { queries: 0, seconds: 0, latencies: [] as number[], proxy: 0, pg: 0, client: 0, started: 0, ended: 0 }]))])) as Record<BusyPath, Record<BusyWorkload, Totals>>
  const window = async (p: BusyPath, w: BusyWorkload, ms: number, t?: Totals) => {
    gc()
    const [proxy0, pg0, client0] = [servers[p]!.cpu(), treeCpu(postmaster), process.cpuUsage()]
    const t0 = performance.now()
    const deadline = t0 + ms
    await Promise.all(
      clients[p]!.map(async (c, s) => {
        for (let i = s; performance.now() < deadline; i += BUSY_SESSIONS) {
          const q0 = performance.now()
          await c.query(BUSY_WORKLOADS[w], [(i % ITEMS) + 1])
          t?.latencies.push(performance.now() - q0)
        }
      })
    )
    if (!t) return
    const pgCpu = cpuBetween(pg0, treeCpu(postmaster))
    const client = process.cpuUsage(client0)
    t.client += (client.user + client.system) / 1e6
    t.seconds += (performance.now() - t0) / 1000
    t.queries = t.latencies.length
    t.proxy += servers[p]!.cpu() - proxy0
    t.pg += pgCpu.seconds
    t.started += pgCpu.started
    t.ended += pgCpu.ended
  }
  try {
    for (const p of paths) {
      servers[p] = await starts[p]()
      clients[p] = Array.from({ length: BUSY_SESSIONS }, () => new Client(servers[p]!.config))
      await Promise.all(clients[p]!.map(async (c) => (c.on('error', () => {}), await c.connect())))
      for (const w of workloads) await window(p, w, BUSY_WARM_MS)
    }
    await interleave(workloads.flatMap((w) => paths.map((p) => `${p}|${w}`)), BUSY_ROUNDS, async (key) => {
      const [p, w] = key.split('|') as [BusyPath, BusyWorkload]
      await window(p, w, BUSY_MS, totals[p][w])
    })
  } finally {
    await Promise.all(Object.values(clients).flat().map((c) => bounded(c.end(), 5000).catch(() => {})))
    for (const p of paths) await servers[p]?.stop()
  }
  const figure = (m: BusyMetric, p: BusyPath, w: BusyWorkload) =>
    ((t) => (m === 'queries/s' ? t.queries / t.seconds : ((m === 'proxy CPU / statement' ? t.proxy : m === 'client CPU / statement' ? t.client : t.pg) * 1e6) / t.queries))(totals[p][w])
  const shown = (m: BusyMetric, x: number) => (m === 'queries/s' ? `${Math.round(x).toLocaleString('en-US')}/s` : `${x.toFixed(1)} µs`)
  // Client, proxy and Postgres share the machine's cores: a path's rate is at most the cores over the CPU all three spend per statement.
  const spent = (p: BusyPath, w: BusyWorkload) => (['proxy CPU / statement', 'Postgres CPU / statement', 'client CPU / statement'] as const).reduce((n, m) => n + figure(m, p, w), 0)
  const bound = (p: BusyPath, w: BusyWorkload) => (CORES * 1e6) / spent(p, w)
  const ratios = workloads.flatMap((w) =>
    BUSY_RATIOS.filter((r) => paths.includes(r.over)).map((r) => {
      const [tx, other] = [figure(r.metric, 'transaction', w), figure(r.metric, r.over, w)]
      const atLeast = r.metric === 'queries/s'
      return { ...r, w, tx, other, ratio: tx / other, pass: atLeast ? tx / other >= r.target : tx / other <= r.target, atLeast }
    })
  )
  const over = (p: BusyPath) => (p === 'session' ? 'session mode' : p === 'floor' ? 'the floor' : `PgBouncer ${p}`)
  const lat = (t: Totals) => `${median(t.latencies).toFixed(2)} / ${percentile(t.latencies, 99).toFixed(2)} ms`
  const all = (k: 'started' | 'ended') => paths.flatMap((p) => workloads.map((w) => totals[p][w][k])).reduce((a, b) => a + b, 0)
  printGrid(
    `pool 2: ${BUSY_SESSIONS} busy sessions, back to back`,
    ['metric', ...paths.map((p) => BUSY_NAMES[p]), 'ratio', 'target', 'result'],
    workloads.flatMap((w) => [
      ...(['queries/s', 'proxy CPU / statement', 'Postgres CPU / statement', 'client CPU / statement'] as const).map((m) => [`${w}: ${m}`, ...paths.map((p) => shown(m, figure(m, p, w)))]),
      [`${w}: at most ${CORES} cores / all three (queries/s)`, ...paths.map((p) => shown('queries/s', bound(p, w)))],
      [`${w}: latency p50 / p99`, ...paths.map((p) => lat(totals[p][w]))],
      ...ratios.filter((r) => r.w === w).map((r) => [`${w}: transaction mode's ${r.metric} over ${over(r.over)}'s`, ...paths.map(() => ''), `${r.ratio.toFixed(2)}x`, `${r.atLeast ? '>=' : '<='} ${r.target}x`, r.pass ? 'pass' : 'MISS']),
    ]),
    [
      `${BUSY_SESSIONS} edgepg Clients (scram_user) per path, all logged in before any window, each running the workload's statement back to back (unnamed, $1 an id of ${ITEMS}; read by id: "${READ}"); ` +
        `${BUSY_ROUNDS} rounds of ${BUSY_MS / 1000} s per path and workload, taking turns (after ${BUSY_WARM_MS} ms of each, unmeasured). ` +
        `Session mode: ${SESSION_MODE_FLAGS.join(' ')}; transaction mode: ${POOL_PROXY_FLAGS.join(' ')} (bench/pool.ts).`,
      `The floor: bench/ws-pool-floor.ts, the least a transaction pooler over WebSockets does (${BOUNCER_POOL} backends it logged in itself, a backend per client message, ` +
        `free again at an idle ReadyForQuery; no login, isolation, limits or metrics). ` +
        workloads.map((w) => `${w}: transaction mode's proxy CPU is ${(figure('proxy CPU / statement', 'transaction', w) / figure('proxy CPU / statement', 'floor', w)).toFixed(2)}x the floor's, session mode's ${(figure('proxy CPU / statement', 'session', w) / figure('proxy CPU / statement', 'floor', w)).toFixed(2)}x`).join('; ') + '.',
      ...(neonPairMissing()
        ? [neonPairMissing()!]
        : [`wsproxy → PgBouncer: edgepg Clients through Neon's wsproxy in front of PgBouncer 1.18 (pool_mode transaction, default_pool_size ${BOUNCER_POOL}, ` +
            `scram_user's SCRAM secret in its userlist; bench/neon-pair.ts); unsafe as Neon runs it: session state (SET, prepared statements, temp tables) leaks to other clients. ` +
            `Safe: the same with server_reset_query_always = 1, so PgBouncer sends server_reset_query (DISCARD ALL) after every transaction.`]),
      `Proxy CPU: user + system time (/proc/<pid>/stat, 10 ms ticks) of the proxy child and its descendants (EDGEPG_WORKERS=1 here, so one process), or of wsproxy and PgBouncer, ` +
        `over the windows, divided by the statements answered in them; each statement is a transaction of its own. Postgres CPU: the same for the postmaster (pid ${postmaster}) and ` +
        `every process below it (all backends of every path, background workers), process by process; Postgres processes started during a window (counted whole) / ended (their time lost): ${all('started')} / ${all('ended')}. ` +
        `Client CPU: this process's (the ${BUSY_SESSIONS} edgepg Clients), the same way.`,
      ...(paths.includes('safe')
        ? workloads.map((w) => {
            // At 1.25x PgBouncer safe's rate, with the cores as busy as they were for it, the three may spend its CPU per statement over 1.25;
            // what transaction mode's client and Postgres take of that leaves the rest to the proxy.
            const allowed = spent('safe', w) / 1.25
            const left = allowed - figure('client CPU / statement', 'transaction', w) - figure('Postgres CPU / statement', 'transaction', w)
            const proxy = (p: BusyPath) => `${figure('proxy CPU / statement', p, w).toFixed(1)} µs`
            return `${w}: at 1.25x PgBouncer's safe rate, with the cores as busy as they were for it, client, proxy and Postgres may spend ${allowed.toFixed(1)} µs per statement together (it spent ${spent('safe', w).toFixed(1)}); ` +
              `transaction mode's client and Postgres take all but ${left.toFixed(1)} µs of it, what its proxy could spend: it spends ${proxy('transaction')}, session mode's ${proxy('session')}${paths.includes('floor') ? `, the floor's ${proxy('floor')}` : ''}.`
          })
        : []),
    ]
  )
  return ratios.map((r) => ({
    metric: `pool: busy sessions, ${r.w}: ${r.atLeast ? `${over(r.over)}'s ${r.metric} over transaction mode's` : `transaction mode's ${r.metric} over ${over(r.over)}'s`}`,
    edgepg: shown(r.metric, r.tx),
    baseline: shown(r.metric, r.other),
    // Summary rows pass at or below their target: "at least" ratios go in upside down.
    ratio: r.atLeast ? 1 / r.ratio : r.ratio,
    target: r.atLeast ? 1 / r.target : r.target,
  }))
}

// ---- 3. /sql at 32 in flight ----

async function sqlInFlight(ctx: BenchContext) {
  const cfg = ctx.pgConfig()
  const connectionString = `postgresql://${cfg.user}:${encodeURIComponent(String(cfg.password))}@${cfg.host}:${cfg.port}/${cfg.database}`
  const headers = { 'neon-connection-string': connectionString, 'neon-raw-text-output': 'true', 'neon-array-mode': 'true', 'content-type': 'application/json' }
  const proxy = await startChildProxy(`${ctx.pg.host}:${ctx.pg.port}`, { built: true, flags: POOL_PROXY_FLAGS })
  const floor = await startHttpPg(connectionString).catch(async (err) => (await proxy.stop(), Promise.reject(err)))
  type Side = 'sql' | 'floor'
  const SIDES = ['sql', 'floor'] as const
  const posters: Record<Side, ReturnType<typeof leanPoster>> = { sql: leanPoster(`http://127.0.0.1:${proxy.port}/sql`, headers), floor: leanPoster(`http://127.0.0.1:${floor.port}/sql`, headers) }
  const rps: Record<Side, number[]> = { sql: [], floor: [] }
  let n = 0
  const one = async (side: Side) => {
    const v = ++n % 1_000_000
    const text = await posters[side].post(JSON.stringify({ query: 'SELECT $1::int AS v', params: [v] }))
    if (!text.includes(side === 'sql' ? `[["${v}"]]` : `[[${v}]]`)) throw new Error(`pool bench: ${side} answered ${text}`)
  }
  const run = async (side: Side, total: number) => {
    let issued = 0
    const t0 = performance.now()
    await Promise.all(Array.from({ length: SQL_IN_FLIGHT }, async () => {
      while (issued++ < total) await one(side)
    }))
    return total / ((performance.now() - t0) / 1000)
  }
  try {
    for (const side of SIDES) await run(side, SQL_WARMUP)
    await interleave(SIDES, SQL_ROUNDS, async (side) => {
      gc()
      rps[side].push(await run(side, SQL_REQUESTS))
    })
  } finally {
    for (const side of SIDES) posters[side].close()
    await proxy.stop()
    await floor.stop()
  }
  const r = { sql: median(rps.sql), floor: median(rps.floor) }
  printGrid(
    `pool 3: POST /sql, ${SQL_IN_FLIGHT} in flight`,
    ['metric', `POST /sql (edgepg-proxy, ${MODE})`, 'floor: bare HTTP server + pg.Pool', 'ratio'],
    [[`requests/s (median of ${SQL_ROUNDS} x ${SQL_REQUESTS})`, `${Math.round(r.sql).toLocaleString('en-US')}/s`, `${Math.round(r.floor).toLocaleString('en-US')}/s`, `${(r.sql / r.floor).toFixed(2)}x`]],
    [
      `Body {"query":"SELECT $1::int AS v","params":[n]}, role scram_user, from node:http on a keep-alive agent (${SQL_IN_FLIGHT} sockets); ${SQL_WARMUP} requests of warm-up per side, then alternating rounds. ` +
        `The floor is bench/http-pg.ts in a child process: parse the JSON, pg.Pool (max 32) query, answer the rows. edgepg-proxy: a child with ${POOL_PROXY_FLAGS.join(' ')}.`,
    ]
  )
}

// ---- 4. memory per idle session ----

async function idleMemory() {
  // In session mode every idle session holds a backend: a Postgres of its own with room for them.
  const db = await startPostgres({ name: 'bench-pool', settings: { max_connections: String(IDLE_SESSIONS + 100), shared_buffers: '32MB' } })
  const admin = db.admin()
  const clients: pg.Client[] = []
  let proxy: Awaited<ReturnType<typeof startGcProxy>> | undefined
  try {
    await admin.connect()
    proxy = await startGcProxy(`${db.host}:${db.port}`, POOL_PROXY_FLAGS)
    const open = () => {
      const c = new Client({ host: db.host, port: db.port, database: db.database, user: 'scram_user', password: PASSWORD, webSocketConstructor: WebSocket as any, wsProxy: () => proxy!.url } as ClientConfig)
      c.on('error', () => {})
      clients.push(c)
      return c
    }
    // Warm-up: the proxy's code paths loaded and its first allocations made before "before".
    for (let i = 0; i < 20; i++) {
      const c = open()
      await c.connect()
      await c.query('SELECT 1')
      await c.end()
    }
    await sleep(SETTLE_MS)
    const before = { rss: proxy.rss(), gc: (await proxy.memoryAfterGc()).rss }
    const backends = async () => (await admin.query(`SELECT count(*)::int AS n FROM pg_stat_activity WHERE usename = 'scram_user' AND backend_type = 'client backend'`)).rows[0].n as number
    const backendsBefore = await backends()
    const connecting = slots(CONNECTING)
    const t0 = performance.now()
    const failed = new Map<string, number>()
    await Promise.all(Array.from({ length: IDLE_SESSIONS }, () => connecting(() => open().connect()).catch((err) => count(failed, err))))
    const loginSeconds = (performance.now() - t0) / 1000
    await sleep(SETTLE_MS)
    const after = { rss: proxy.rss(), gc: (await proxy.memoryAfterGc()).rss }
    const backendsAfter = await backends()
    const idle = IDLE_SESSIONS - [...failed.values()].reduce((a, b) => a + b, 0)
    const per = (a: number, b: number) => ((b - a) / idle / 1024).toFixed(1)
    const mib = (b: number) => (b / MiB).toFixed(1)
    printGrid(
      `pool 4: edgepg-proxy's memory per idle logged-in session (${MODE})`,
      ['metric', 'RSS', 'RSS after a full GC'],
      [
        ['proxy, before', `${mib(before.rss)} MiB`, `${mib(before.gc)} MiB`],
        [`proxy, ${idle} idle sessions later`, `${mib(after.rss)} MiB`, `${mib(after.gc)} MiB`],
        ['per idle session', `${per(before.rss, after.rss)} KiB`, `${per(before.gc, after.gc)} KiB`],
        ['per 1,000 idle sessions', `${((1000 * (after.rss - before.rss)) / idle / MiB).toFixed(1)} MiB`, `${((1000 * (after.gc - before.gc)) / idle / MiB).toFixed(1)} MiB`],
      ],
      [
        `${IDLE_SESSIONS} edgepg Clients (scram_user) connect (${CONNECTING} at once; ${loginSeconds.toFixed(1)} s; failed: ${counts(failed)}) and then do nothing. ` +
          `RSS of the proxy child (tsx proxy/cli.ts, from /proc) ${SETTLE_MS / 1000} s after a warm-up of 20 sessions and again ${SETTLE_MS / 1000} s after the last login; ` +
          `then after a full GC in the child (SIGUSR2 preload, test/support/child-proxy.ts). Flags: ${POOL_PROXY_FLAGS.join(' ')}.`,
        `Postgres backends of scram_user: ${backendsBefore} before (the proxy's warm pool), ${backendsAfter} with the idle sessions ` +
          `(a Postgres of this case's own, max_connections ${IDLE_SESSIONS + 100}: in session mode each session holds one).`,
      ]
    )
  } finally {
    await Promise.all(clients.map((c) => bounded(c.end(), 5000).catch(() => {})))
    await proxy?.stop()
    await admin.end().catch(() => {})
    await db.stop()
  }
}

// ---- 5. bursts of many sessions, run after run ----

/** Case 5's session counts (EDGEPG_BENCH_POOL_BURSTS, comma-separated), each capped by open files as case 1 is. */
const BURSTS = (process.env.EDGEPG_BENCH_POOL_BURSTS ?? '1500,5000').split(',').map((n) => Math.min(Number(n), Math.floor((NOFILE - FD_SPARE) / 2)))
/** Runs per path and session count (EDGEPG_BENCH_POOL_RUNS): a pool whose latency depends on luck shows it here. */
const BURST_RUNS = Number(process.env.EDGEPG_BENCH_POOL_RUNS ?? 5)
/** Each session: this many rounds of a statement and a named insert, each round at a random moment of its BURST_SPREAD_MS. */
const BURST_ROUNDS = 3
const BURST_SPREAD_MS = 2600
const BURST_SELECT = 'SELECT $1::int'
/** Targets (issue 48), ratios to the pair's (wsproxy → PgBouncer, the same Client) in the same run; PgBouncer's where the pair is missing. */
const BURST_P50_TARGET = 1.2
const BURST_P99_TARGET = 1.5
const BOUNCER_PATH = 'pg via PgBouncer 1.18 (transaction)'
/** The pair with DISCARD ALL after every transaction: it isolates sessions as edgepg-proxy does (a reset at each handover). */
const SAFE_PAIR = 'the same pair, server_reset_query_always (safe)'

/**
 * The workload of issue 36: sessions that each run BURST_SELECT and an INSERT BURST_ROUNDS times over
 * ~8 s, on the limited role, through edgepg-proxy as deployed (its default --workers) and with one
 * worker, PgBouncer, and wsproxy → PgBouncer; BURST_RUNS runs of each, the paths taking turns, with the
 * insert unnamed (every path does the same work: the latencies compared); then one run each with the
 * insert named, as pg's { name } sends it (what each path keeps of it).
 */
async function bursts(ctx: BenchContext, admin: pg.Client) {
  const role = { host: ctx.pg.host, port: ctx.pg.port, database: ctx.pg.database, user: ROLE, password: ROLE_PASSWORD, query_timeout: QUERY_TIMEOUT_MS }
  type Path = { name: string; start(n: number): Promise<{ open(): pg.Client; stop(): Promise<void> }> }
  const edgepg = (name: string, workers: string, built: string | true = true): Path => ({
    name,
    start: async () => {
      const p = await startChildProxy(`${ctx.pg.host}:${ctx.pg.port}`, { built, flags: POOL_PROXY_FLAGS, env: { EDGEPG_WORKERS: workers } })
      return { open: () => new Client({ ...role, webSocketConstructor: WebSocket as any, wsProxy: () => p.url } as ClientConfig), stop: p.stop }
    },
  })
  const paths: Path[] = [
    edgepg('edgepg-proxy (default --workers)', 'cores'),
    edgepg('edgepg-proxy (--workers 1)', '1'),
    // (EDGEPG_BENCH_POOL_OTHER_BUILD: another build's dist/cli.mjs beside this one, with the default workers, as a change's baseline.)
    ...(process.env.EDGEPG_BENCH_POOL_OTHER_BUILD ? [edgepg(`edgepg-proxy (default --workers), ${process.env.EDGEPG_BENCH_POOL_OTHER_BUILD}`, 'cores', process.env.EDGEPG_BENCH_POOL_OTHER_BUILD)] : []),
    ...(pgbouncerBinary()
      ? [{ name: BOUNCER_PATH, start: async (n: number) => ((b) => ({ open: () => new pg.Client({ ...role, port: b.port }), stop: b.stop }))(await startPgBouncer(ctx.pg, { default_pool_size: BOUNCER_POOL, max_client_conn: n + 100 }, await scramSecrets(admin, [ROLE]))) }]
      : []),
    ...(neonPairMissing()
      ? []
      : [false, true].map((safe) => ({
          name: safe ? SAFE_PAIR : NEON_PAIR,
          start: async (n: number) => ((p) => ({ open: () => new Client(p.config(role)), stop: p.stop }))(await startNeonPair(ctx.pg, admin, [ROLE], { default_pool_size: BOUNCER_POOL, max_client_conn: n + 100, ...(safe && { server_reset_query_always: 1 }) })),
        }))),
  ]
  for (const n of BURSTS) {
    const results = new Map<string, Array<Burst>>(paths.map((p) => [p.name, []]))
    const named = new Map<string, Burst>()
    for (let run = 0; run <= BURST_RUNS; run++) {
      for (const path of paths) {
        const server = await path.start(n)
        try {
          const r = await burst(n, server.open, run === BURST_RUNS)
          run === BURST_RUNS ? named.set(path.name, r) : results.get(path.name)!.push(r)
        } finally {
          await server.stop()
        }
        await waitForNoBackends(admin)
      }
    }
    const peerName = results.has(NEON_PAIR) ? NEON_PAIR : BOUNCER_PATH
    const peer = results.get(peerName)
    const all = (r: Burst) => [...r.selects, ...r.inserts]
    const cell = (r: Burst, i: number) => {
      const [p50, p99] = [percentile(all(r), 50), percentile(all(r), 99)]
      const b = peer?.[i]
      const over = b ? ` (${(p50 / percentile(all(b), 50)).toFixed(1)}x / ${(p99 / percentile(all(b), 99)).toFixed(1)}x)` : ''
      return `${p50.toFixed(2)} / ${p99.toFixed(1)} ms${over}${r.failed.size ? `, failed ${counts(r.failed)}` : ''}`
    }
    const within = (path: string, against = peer) =>
      against &&
      results.get(path)!.filter((r, i) => percentile(all(r), 50) <= BURST_P50_TARGET * percentile(all(against[i]), 50) && percentile(all(r), 99) <= BURST_P99_TARGET * percentile(all(against[i]), 99) && !r.failed.has('53300')).length
    const safe = results.get(SAFE_PAIR)
    printGrid(
      `pool 5: ${n} sessions, each ${BURST_ROUNDS} x ("${BURST_SELECT}", an INSERT) over ~${(BURST_ROUNDS * BURST_SPREAD_MS) / 1000} s, role limited to ${ROLE_LIMIT} connections, ${BURST_RUNS} runs`,
      ['run', ...paths.map((p) => `${p.name}: p50 / p99 (over ${peerName === NEON_PAIR ? "the pair's" : "PgBouncer's"})`)],
      [
        ...Array.from({ length: BURST_RUNS }, (_, i) => [String(i + 1), ...paths.map((p) => cell(results.get(p.name)![i], i))]),
        ['named', ...paths.map((p) => `inserts kept ${named.get(p.name)!.inserts.length} of ${BURST_ROUNDS * n}${named.get(p.name)!.failed.size ? ` (failed ${counts(named.get(p.name)!.failed)})` : ''}`)],
      ],
      [
        `Each session connects (${CONNECTING} logins under way at once); once all have, each runs ${BURST_ROUNDS} rounds, each at a random moment of ${BURST_SPREAD_MS} ms: ` +
          `"${BURST_SELECT}", then up to 100 ms later "${INSERT}", both unnamed in runs 1 to ${BURST_RUNS} (every path does the same work); p50 / p99 per statement. ` +
          `Run "named": the insert as pg's { name, text, values } (Parse the first time, Bind by name after), as an application that prepares its statements sends it; PgBouncer 1.18 fails named statements (42P05, 26000). Runs take turns by path, each on a server started for it.`,
        `edgepg-proxy: a child with ${POOL_PROXY_FLAGS.join(' ')} and EDGEPG_WORKERS=cores (the default: ${Math.min(availableParallelism(), BOUNCER_POOL)} workers here: one pool, its backends moving to the worker whose sessions wait); and with one worker. ` +
          `"${SAFE_PAIR}": PgBouncer resetting its backend after each transaction, as edgepg-proxy resets at each handover (the pair resets nothing: a session may read what another left). ` +
          (!peer
            ? 'Neither PgBouncer nor the pair is installed: no ratios.'
            : `Target (issue 48): p50 <= ${BURST_P50_TARGET}x and p99 <= ${BURST_P99_TARGET}x ${peerName}'s in every run, no 53300: met in ${within(paths[0].name)} of ${BURST_RUNS} (default workers), ${within(paths[1].name)} of ${BURST_RUNS} (one worker).` +
              (safe ? ` The same bounds over the safe pair's: met in ${within(paths[0].name, safe)} of ${BURST_RUNS} (default workers), ${within(paths[1].name, safe)} of ${BURST_RUNS} (one worker).` : '')),
      ]
    )
  }
}

/** One run of case 5 on one path: the latencies of every session's selects and inserts, and its failures. */
type Burst = { selects: number[]; inserts: number[]; failed: Map<string, number> }

async function burst(n: number, open: () => pg.Client, named: boolean): Promise<Burst> {
  const clients: pg.Client[] = []
  const selects: number[] = []
  const inserts: number[] = []
  const failed = new Map<string, number>()
  const connecting = slots(CONNECTING)
  const connected = (await Promise.all(Array.from({ length: n }, async () => {
    const c = open()
    c.on('error', () => {})
    clients.push(c)
    return connecting(() => bounded(c.connect(), CONNECT_TIMEOUT_MS)).then(() => c, (err) => void count(failed, err))
  }))).filter((c): c is pg.Client => c !== undefined)
  const timed = async (c: pg.Client, query: pg.QueryConfig, latencies: number[]) => {
    const t0 = performance.now()
    await c.query(query).then(() => latencies.push(performance.now() - t0), (err) => count(failed, err))
  }
  try {
    await Promise.all(connected.map(async (c, i) => {
      for (let round = 0; round < BURST_ROUNDS; round++) {
        await sleep(Math.random() * BURST_SPREAD_MS)
        await timed(c, { text: BURST_SELECT, values: [i] }, selects)
        await sleep(Math.random() * 100)
        await timed(c, { ...(named && { name: 'bench_pool_insert' }), text: INSERT, values: [i] }, inserts)
      }
    }))
  } finally {
    await Promise.all(clients.map((c) => bounded(c.end(), 5000).catch(() => {})))
  }
  return { selects, inserts, failed }
}

// ---- helpers ----

/** An error's SQLSTATE, else its message's start (a refused upgrade, a timeout). */
const errorKey = (err: unknown) => {
  const code = (err as { code?: unknown }).code
  return typeof code === 'string' && /^[0-9A-Z]{5}$/.test(code) ? code : String((err as Error).message ?? err).slice(0, 40)
}

function count(counts: Map<string, number>, err: unknown) {
  const key = errorKey(err)
  counts.set(key, (counts.get(key) ?? 0) + 1)
}

function counts(m: Map<string, number>): string {
  const total = [...m.values()].reduce((a, b) => a + b, 0)
  return total ? `${total} (${[...m].sort((a, b) => b[1] - a[1]).map(([k, n]) => `${k} ×${n}`).join(', ')})` : '0'
}

/** Runs at most `n` of the functions given at once; the rest wait their turn in order. */
function slots(n: number) {
  let free = n
  const waiting: Array<() => void> = []
  return async <T>(fn: () => Promise<T>): Promise<T> => {
    if (free > 0) free--
    else await new Promise<void>((resolve) => waiting.push(resolve))
    try {
      return await fn()
    } finally {
      const next = waiting.shift()
      next ? next() : free++
    }
  }
}

function bounded<T>(promise: Promise<T>, ms: number): Promise<T> {
  let timer: NodeJS.Timeout | undefined
  const timeout = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error('timeout')), ms)))
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer))
}
