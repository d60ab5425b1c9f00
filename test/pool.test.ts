/**
 * Warm backends: a session whose login matches an idle pooled backend is served by it, with no
 * fork and no authentication at Postgres, and finds nothing of the sessions before it. Against a
 * Postgres of this file's own, through the real proxy.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import net from 'node:net'
import pg from 'pg'
import { WebSocket } from 'ws'
import { createProxy, type ProxyOptions } from '../proxy/index'
import { Client, Pool, type ClientConfig } from '../src/index'
import { generateCerts } from './support/certs'
import { startHoldingRelay } from './support/delay-relay'
import { eventually, within } from './support/helpers'
import { startPgBouncer } from './support/pgbouncer'
import { pgConfig, startPostgres, tlsOnly, type Postgres, type Role } from './support/stack'

let own: Postgres
before(async () => {
  own = await startPostgres({ name: 'pool-pg' })
})
after(async () => {
  await own?.stop()
})

type TestProxy = Awaited<ReturnType<typeof startProxy>>
/** A proxy in session mode (unless `pool` says otherwise): warm backends as sessions hold them, login to end. */
async function startProxy(pool: ProxyOptions['pool'] = {}, options: Partial<ProxyOptions> = {}) {
  const proxy = createProxy({ upstream: `${own.host}:${own.port}`, pool: { mode: 'session', ...pool }, ...options })
  const { port } = await proxy.listen(0, '127.0.0.1')
  const metric = async (name: string) => (await proxy.metrics.registry.getSingleMetric(`edgepg_proxy_${name}`)!.get()).values[0]?.value ?? 0
  const stats = async () => ({
    hits: await metric('pool_hits_total'),
    misses: await metric('pool_misses_total'),
    resets: await metric('pool_resets_total'),
    discards: await metric('pool_discards_total'),
    pooled: await metric('pool_backends'),
    idle: await metric('pool_idle_backends'),
  })
  return Object.assign(proxy, { port, stats })
}

const config = (proxy: TestProxy, role: Role = 'scram_user', extra: ClientConfig = {}): ClientConfig => ({
  ...pgConfig(role, own),
  webSocketConstructor: WebSocket as any,
  wsProxy: () => `ws://127.0.0.1:${proxy.port}/v2`,
  ...extra,
})

/** POST /sql to the proxy as scram_user, with `host:port` in the connection string: a query's first row (status 200 asserted). */
function sqlVia(proxy: TestProxy, hostPort: string) {
  const { user, password, database } = pgConfig('scram_user', own)
  const conn = `postgresql://${user}:${encodeURIComponent(String(password))}@${hostPort}/${database}`
  return async (query: string) => {
    const res = await fetch(`http://127.0.0.1:${proxy.port}/sql`, { method: 'POST', headers: { 'Neon-Connection-String': conn }, body: JSON.stringify({ query }) })
    const body = await res.json()
    assert.equal(res.status, 200, JSON.stringify(body))
    return body.rows[0]
  }
}

/** Backends Postgres has for `application_name` (other than the asker's). */
async function backendsOf(app: string): Promise<number[]> {
  const admin = own.admin()
  await admin.connect()
  try {
    const { rows } = await admin.query('SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid() ORDER BY pid', [app])
    return rows.map((r) => r.pid)
  } finally {
    await admin.end()
  }
}

/** Runs `fn` on a new connected client, then ends it; resolves with what fn returned and the backend's pid. */
async function session<T>(cfg: ClientConfig, fn: (c: Client) => Promise<T> = async () => undefined as T, direct = true) {
  const client = new Client(cfg)
  await within(10000, 'connect', client.connect())
  try {
    const pid = (await client.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
    // (Behind PgBouncer, processID is PgBouncer's, as over TCP.)
    if (direct) assert.equal((client as any).processID, pid, 'processID is the real backend pid')
    return { pid, result: await fn(client) }
  } finally {
    await client.end()
  }
}

/** Everything a session can leave behind, as the next session on the same backend would see it. */
const STATE = `SELECT current_setting('search_path') AS search_path,
  current_setting('edgepg_test.leak', true) AS custom,
  current_setting('statement_timeout') AS statement_timeout,
  current_setting('application_name') AS application_name,
  current_user::text AS current_user, session_user::text AS session_user,
  (SELECT count(*)::int FROM pg_prepared_statements) AS prepared,
  (SELECT count(*)::int FROM pg_cursors) AS cursors,
  (SELECT count(*)::int FROM pg_listening_channels()) AS listening,
  (SELECT count(*)::int FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()) AS advisory_locks,
  (SELECT count(*)::int FROM pg_class WHERE relnamespace = pg_my_temp_schema()) AS temp_relations,
  (SELECT xact_start = query_start FROM pg_stat_activity WHERE pid = pg_backend_pid()) AS no_open_transaction`

const LEAVE_BEHIND = [
  'SET search_path TO pg_catalog',
  "SET statement_timeout = '1234s'",
  "SET application_name = 'changed'",
  'CREATE TEMP TABLE leak (x int)',
  'PREPARE leak_stmt AS SELECT 1',
  'BEGIN',
  'DECLARE leak_cursor CURSOR WITH HOLD FOR SELECT 1',
  'COMMIT',
  'LISTEN leak_channel',
  'SELECT pg_advisory_lock(4242)',
  'SET ROLE md5_user',
  'SELECT setseed(0.42)',
]

test('nothing leaks into the next session: SET, set_config, temp tables, prepared statements, cursors, LISTEN, advisory locks, role, random()\'s seed, open or failed transactions', async () => {
  const proxy = await startProxy()
  try {
    const app = 'edgepg-pool-leak'
    const cfg = config(proxy, 'scram_user', { application_name: app })
    // What a fresh backend looks like, to the same login over TCP.
    const fresh = new pg.Client({ ...pgConfig('scram_user', own), application_name: app })
    await fresh.connect()
    const clean = (await fresh.query(STATE)).rows[0]
    await fresh.query('SELECT setseed(0.42)')
    const seeded = (await fresh.query('SELECT random() AS r')).rows[0].r
    await fresh.end()

    for (const ending of ['idle', 'in a transaction', 'in a failed transaction'] as const) {
      const first = await session(cfg, async (c) => {
        for (const sql of LEAVE_BEHIND) await c.query(sql)
        assert.notDeepEqual((await c.query(STATE)).rows[0], clean, 'the session did change things')
        if (ending !== 'idle') await c.query('BEGIN')
        if (ending === 'in a failed transaction') await c.query('SELECT 1/0').catch(() => {})
      })
      const second = await session(cfg, async (c) => ({ ...(await c.query(STATE)).rows[0], ...(await c.query('SELECT random() AS r')).rows[0] }))
      assert.equal(second.pid, first.pid, `${ending}: the same backend served the next session`)
      const { r, ...state } = second.result
      assert.deepEqual(state, clean, `${ending}: it looks like a fresh backend`)
      assert.notEqual(r, seeded, `${ending}: random() draws from a fresh seed, not the last session's`)
    }
    await eventually(async () => (await proxy.stats()).resets === 6, 'each session’s backend reset after it (six resets)')
    const stats = await proxy.stats()
    assert.deepEqual([stats.misses, stats.hits], [1, 5], 'one cold session, five warm ones')
    const { pid } = await session(cfg)
    assert.deepEqual(await backendsOf(app), [pid], 'one backend forked in all')

    // A custom setting leaves a placeholder DISCARD ALL cannot remove ('' instead of NULL): that
    // backend is not reused, however the setting was made.
    for (const sql of ["SELECT set_config('edgepg_test.leak', 'secret', false)", "SET edgepg_test.leak = 'secret'", "BEGIN; SET LOCAL \"edgepg_test\".leak = 'x'; COMMIT"]) {
      const setter = await session(cfg, (c) => c.query(sql))
      const next = await session(cfg, async (c) => (await c.query(STATE)).rows[0])
      assert.notEqual(next.pid, setter.pid, `${sql}: a fresh backend next`)
      assert.deepEqual(next.result, clean, `${sql}: nothing of it seen`)
    }
  } finally {
    await proxy.close()
  }
})

test('one pool for WebSocket sessions and /sql: a backend warmed by either serves the other, reset in between', async () => {
  const proxy = await startProxy()
  try {
    const cfg = config(proxy)
    const sql = sqlVia(proxy, `${own.host}:${own.port}`)
    const fresh = new pg.Client(pgConfig('scram_user', own))
    await fresh.connect()
    const clean = (await fresh.query(STATE)).rows[0]
    await fresh.query('SELECT setseed(0.42)')
    const seeded = (await fresh.query('SELECT random() AS r')).rows[0].r
    await fresh.end()

    const warmedByWs = await session(cfg, async (c) => {
      for (const statement of LEAVE_BEHIND) await c.query(statement)
    })
    const viaSql = await sql(`SELECT pg_backend_pid() AS pid, ${STATE.slice('SELECT '.length)}`)
    assert.equal(viaSql.pid, warmedByWs.pid, '/sql was served by the backend a WebSocket session warmed')
    // (Seen from inside an extended-protocol statement: its own portal is a cursor, its transaction began at Bind.)
    const ownStatement = { pid: undefined, statement_timeout: undefined, cursors: undefined, no_open_transaction: undefined }
    assert.deepEqual({ ...viaSql, ...ownStatement }, { ...clean, ...ownStatement }, '/sql sees nothing of that session')
    assert.equal(viaSql.statement_timeout, '1min', 'with /sql’s own statement timeout')

    // /sql leaves things behind; the next WebSocket session on that backend sees none of them.
    for (const statement of ['SET search_path TO pg_catalog', 'CREATE TEMP TABLE leak (x int)', 'SELECT pg_advisory_lock(4242)', 'BEGIN']) await sql(statement)
    const next = await session(cfg, async (c) => (await c.query(STATE)).rows[0])
    assert.equal(next.pid, warmedByWs.pid, 'the WebSocket session was served by the backend /sql used')
    assert.deepEqual(next.result, clean, 'it looks like a fresh backend (statement_timeout too)')

    await eventually(async () => (await proxy.stats()).resets === 7, 'reset after each session and request')
    const stats = await proxy.stats()
    assert.deepEqual([stats.misses, stats.hits, stats.pooled], [1, 6, 1], 'one backend forked, for both')

    // A custom setting made over /sql: that backend is not given back, as for a session.
    const setter = await sql(`SELECT pg_backend_pid() AS pid, set_config('edgepg_test.leak', 'secret', false) AS v`)
    assert.equal(setter.pid, warmedByWs.pid)
    const after = await session(cfg, async (c) => (await c.query(STATE)).rows[0])
    assert.notEqual(after.pid, setter.pid, 'a fresh backend after the custom setting')
    assert.deepEqual(after.result, clean, 'nothing of it seen')
  } finally {
    await proxy.close()
  }
})

for (const mode of ['session', 'transaction'] as const) {
  test(`/sql that leaves a transaction open gives its backend back at once: a session right behind it waits for the rollback, no fork (${mode} mode)`, async () => {
    // Postgres's refusal of the reset sent behind the request (DISCARD ALL inside a transaction,
    // 25001) reaches the proxy 300 ms late, long after the response. (Transaction mode sends no
    // reset behind a bare BEGIN, which leaves nothing but the transaction: the pool rolls back.)
    const relay = await startHoldingRelay(own, (type, body) => (type === 'E' && body.includes('C25001\0') ? 300 : 0))
    const upstream = `127.0.0.1:${relay.port}`
    const proxy = await startProxy({ mode }, { upstream })
    try {
      const sql = sqlVia(proxy, upstream)
      const { pid } = await sql('SELECT pg_backend_pid() AS pid')
      await sql('BEGIN')
      const next = await session(config(proxy), async (c) => (await c.query(STATE)).rows[0], mode === 'session')
      assert.equal(next.pid, pid, 'the session was served by the backend /sql left in a transaction')
      assert.equal(next.result.no_open_transaction, true, 'rolled back first')
      assert.equal((await proxy.stats()).misses, 1, 'one backend forked in all')
    } finally {
      await proxy.close()
      await relay.close()
    }
  })
}

test('/sql that leaves a transaction open: the pool resets its backend once every answer to the request\'s reset is in, the last one late (session mode)', async () => {
  // The reset behind the request is two statements: DISCARD ALL, refused inside the transaction
  // (25001), then the reseed, refused in the failed transaction (25P02). The reseed's answer reaches
  // the proxy 300 ms after the refusal's: had the pool's own reset (ROLLBACK first) begun on the
  // refusal, it would have read that answer as its own, failed, and closed the backend.
  const relay = await startHoldingRelay(own, (type, body) => (type === 'E' && body.includes('C25P02\0') ? 300 : 0))
  const upstream = `127.0.0.1:${relay.port}`
  const proxy = await startProxy({}, { upstream })
  try {
    const sql = sqlVia(proxy, upstream)
    const { pid } = await sql('SELECT pg_backend_pid() AS pid')
    await sql('BEGIN')
    const next = await session(config(proxy), async (c) => (await c.query(STATE)).rows[0])
    assert.equal(next.pid, pid, 'the session was served by the backend /sql left in a transaction')
    assert.equal(next.result.no_open_transaction, true, 'rolled back first')
    const stats = await proxy.stats()
    assert.deepEqual([stats.misses, stats.discards], [1, 0], 'one backend forked in all, none closed')
  } finally {
    await proxy.close()
    await relay.close()
  }
})

test('a client that vanishes mid-transaction commits nothing; its backend is not handed out busy', async () => {
  const proxy = await startProxy()
  const admin = own.admin()
  await admin.connect()
  try {
    await admin.query('CREATE TABLE IF NOT EXISTS pool_vanish (x int)')
    const cfg = config(proxy, 'scram_user', { application_name: 'edgepg-pool-vanish' })
    // Gone without a Terminate, idle or busy; or ending (Terminate) while a query runs.
    for (const [busy, ends] of [[false, 'vanishes'], [true, 'vanishes'], [true, 'ends']] as const) {
      const client = new Client(cfg)
      await client.connect()
      await client.query('BEGIN')
      await client.query('INSERT INTO pool_vanish VALUES (1)')
      client.on('error', () => {})
      if (busy) void client.query('SELECT pg_sleep(30)').catch(() => {})
      await new Promise((r) => setTimeout(r, 100))
      if (ends === 'vanishes') (client as any).connection.stream.destroy()
      else await client.end()
      // The next session works at once, not after the busy backend (a 5 s wait would be a bug), with nothing open.
      const next = await within(3000, 'the next session', session(cfg, async (c) => (await c.query(STATE)).rows[0]))
      assert.equal(next.result.no_open_transaction, true, `busy ${busy}, ${ends}`)
    }
    // pg's own suite does this: end() in connect()'s callback, right behind a query, so that the
    // Terminate follows the query in one flight while it runs.
    const ender = new Client(cfg)
    ender.on('error', () => {})
    await new Promise<void>((resolve) => ender.connect(() => (ender.query('SELECT pg_sleep(30)').catch(() => {}), ender.end(), resolve())))
    await within(3000, 'the session after one that ended behind a running query', session(cfg))
    assert.deepEqual((await admin.query('SELECT count(*)::int AS n FROM pool_vanish')).rows, [{ n: 0 }], 'nothing committed')
    await eventually(async () => (await admin.query("SELECT count(*)::int AS n FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)' AND state = 'active'")).rows[0].n === 0, 'the busy backend’s query cancelled')
  } finally {
    await admin.query('DROP TABLE IF EXISTS pool_vanish')
    await admin.end()
    await proxy.close()
  }
})

test('passwords stay checked: a wrong one gets Postgres’s own 28P01 while matching backends sit idle', async () => {
  const proxy = await startProxy()
  try {
    for (const role of ['password_user', 'md5_user', 'scram_user'] as const) {
      const app = `edgepg-pool-pw-${role}`
      await session(config(proxy, role, { application_name: app }))
      const tcp = await new pg.Client({ ...pgConfig(role, own), application_name: app, password: 'wrong' }).connect().then(() => assert.fail('TCP connected'), (e) => e)
      const before = await proxy.stats()
      const edge = await new Client(config(proxy, role, { application_name: app, password: 'wrong' })).connect().then(() => assert.fail('connected'), (e) => e)
      assert.deepEqual({ ...edge, message: edge.message }, { ...tcp, message: tcp.message }, `${role}: as pg over TCP`)
      assert.equal(edge.code, '28P01')
      const after = await proxy.stats()
      assert.equal(after.hits, before.hits, `${role}: the wrong password was not served from the pool`)
      assert.equal(after.idle, before.idle, `${role}: the pooled backend still waits`)
    }
  } finally {
    await proxy.close()
  }
})

test('a password changed in Postgres stops being honoured once the pooled backend reaches its max lifetime', async () => {
  const admin = own.admin()
  await admin.connect()
  await admin.query("CREATE ROLE pool_pw_user LOGIN SUPERUSER PASSWORD 'old-password'")
  const proxy = await startProxy({ maxLifetimeMs: 1500 })
  try {
    const cfg = (password: string) => ({ ...config(proxy, 'scram_user'), user: 'pool_pw_user', password })
    const first = await session(cfg('old-password'))
    await admin.query("ALTER ROLE pool_pw_user PASSWORD 'new-password'")
    const stale = await session(cfg('old-password'))
    assert.equal(stale.pid, first.pid, 'within the lifetime the pool still honours the old password (documented)')
    await new Promise((r) => setTimeout(r, 1600))
    const err: any = await new Client(cfg('old-password')).connect().then(() => assert.fail('connected'), (e) => e)
    assert.equal(err.code, '28P01', 'past the lifetime: refused by Postgres')
    const renewed = await session(cfg('new-password'))
    assert.notEqual(renewed.pid, first.pid)
  } finally {
    await proxy.close()
    await admin.query('DROP ROLE pool_pw_user')
    await admin.end()
  }
})

test('keys: other startup parameters, another user or database get backends of their own', async () => {
  const proxy = await startProxy()
  try {
    const a = await session(config(proxy, 'scram_user', { application_name: 'edgepg-pool-key-a' }))
    const b = await session(config(proxy, 'scram_user', { application_name: 'edgepg-pool-key-b' }))
    const c = await session(config(proxy, 'md5_user', { application_name: 'edgepg-pool-key-a' }))
    assert.equal(new Set([a.pid, b.pid, c.pid]).size, 3)
    assert.equal((await session(config(proxy, 'scram_user', { application_name: 'edgepg-pool-key-b' }))).pid, b.pid)
  } finally {
    await proxy.close()
  }
})

test('faults: a pooled backend killed, or Postgres restarted, costs the next session nothing', async () => {
  const proxy = await startProxy()
  const admin = own.admin()
  await admin.connect()
  try {
    const cfg = config(proxy, 'scram_user', { application_name: 'edgepg-pool-faults' })
    const first = await session(cfg)
    await admin.query('SELECT pg_terminate_backend($1)', [first.pid])
    const next = await session(cfg, async (c) => (await c.query('SELECT 1 AS one')).rows)
    assert.notEqual(next.pid, first.pid)
    assert.deepEqual(next.result, [{ one: 1 }])
    await admin.end()

    await own.shutdown()
    await own.start()
    const afterRestart = await session(cfg, async (c) => (await c.query('SELECT 1 AS one')).rows)
    assert.deepEqual(afterRestart.result, [{ one: 1 }])
    assert.ok((await proxy.stats()).discards >= 2, 'the dead backends were discarded')
  } finally {
    await admin.end().catch(() => {})
    await proxy.close()
  }
})

test('/sql: a warm backend that died unseen is passed over: the request runs once, on another backend', async () => {
  // Between the proxy and Postgres, a relay whose links can go silent: then it drops what the proxy
  // sends and hangs up on it, as a connection that died without a word would.
  const links: Array<{ silent: boolean }> = []
  const relay = net.createServer((front) => {
    const back = net.connect(own.port, own.host)
    const link = { silent: false }
    links.push(link)
    front.on('data', (d) => (link.silent ? (front.destroy(), back.destroy()) : back.write(d)))
    back.on('data', (d) => link.silent || front.write(d))
    for (const [a, b] of [[front, back], [back, front]]) {
      a.on('close', () => b.destroy())
      a.on('error', () => {})
    }
  })
  await new Promise<void>((resolve) => relay.listen(0, '127.0.0.1', resolve))
  const relayPort = (relay.address() as net.AddressInfo).port
  const proxy = await startProxy({}, { upstream: `127.0.0.1:${relayPort}` })
  const admin = own.admin()
  await within(10_000, 'the admin connection', admin.connect())
  try {
    await within(10_000, 'the table', admin.query('CREATE TABLE IF NOT EXISTS pool_once (n int); TRUNCATE pool_once'))
    const sql = sqlVia(proxy, `127.0.0.1:${relayPort}`)
    const first = await within(10_000, 'the first request', sql('SELECT pg_backend_pid() AS pid'))
    assert.equal(links.length, 1)
    links[0].silent = true
    const next = await within(10_000, 'the request on the dead backend', sql('INSERT INTO pool_once VALUES (1) RETURNING pg_backend_pid() AS pid'))
    assert.notEqual(next.pid, first.pid, 'served by a new backend')
    assert.equal((await admin.query('SELECT count(*)::int AS n FROM pool_once')).rows[0].n, 1, 'the statement ran once')
    const stats = await proxy.stats()
    assert.deepEqual([stats.hits, stats.misses, stats.pooled], [1, 2, 1], 'the dead one was taken, then passed over')
  } finally {
    await admin.query('DROP TABLE IF EXISTS pool_once')
    await admin.end()
    await proxy.close()
    relay.close()
  }
})

test('cancel: a session on a pooled backend cancels its query; a stale key from an earlier session cancels nothing', async () => {
  const proxy = await startProxy()
  try {
    const cfg = config(proxy, 'scram_user', { application_name: 'edgepg-pool-cancel' })
    const earlier = new Client(cfg)
    await earlier.connect()
    const staleKey = { pid: (earlier as any).processID, secretKey: (earlier as any).secretKey }
    await earlier.end()

    const client = new Client(cfg)
    await client.connect()
    assert.equal((client as any).processID, staleKey.pid, 'the same backend')
    try {
      const sleeping = client.query('SELECT pg_sleep(1.5) AS slept')
      await new Promise((r) => setTimeout(r, 200))
      // The earlier session's key: Postgres must not see it as this one's.
      // pg's cancel: a connection of the canceller's own, closed by Postgres once it has read the request.
      const cancel = (target: unknown, query: unknown) => {
        const canceller = new Client(cfg) as any
        const done = new Promise((resolve) => canceller.connection.once('end', resolve))
        canceller.connection.on('error', () => {})
        canceller.cancel(target, query)
        return within(5000, 'the cancel connection to close', done)
      }
      await cancel({ processID: staleKey.pid, secretKey: staleKey.secretKey, activeQuery: 'q' }, 'q')
      assert.deepEqual((await within(5000, 'the query', sleeping)).rows, [{ slept: '' }], 'not cancelled by a stale key')

      const running = client.query('SELECT pg_sleep(30)').then(() => assert.fail('not cancelled'), (e) => e)
      await new Promise((r) => setTimeout(r, 200))
      await cancel(client, (client as any)._activeQuery ?? (client as any)._sentQueryQueue[0])
      const err: any = await within(5000, 'the cancelled query', running)
      assert.equal(err.code, '57014')
    } finally {
      await client.end()
    }
  } finally {
    await proxy.close()
  }
})

test('bounded: idle backends per key (--pool-size) and in all, /sql per key, idle timeout; off (or end-to-end auth) means a backend per session', async () => {
  const proxy = await startProxy({ size: 2, maxBackends: 3, idleTimeoutMs: 800, keepWarmMs: 0 }) // (keeping the last warm: test/far.test.ts)
  try {
    const app = 'edgepg-pool-bounds'
    const pool = new Pool({ ...config(proxy, 'scram_user', { application_name: app }), max: 4 })
    const clients = await Promise.all([1, 2, 3, 4].map(() => pool.connect()))
    assert.equal((await proxy.stats()).pooled, 3, 'the pool owns three of the four backends (maxBackends)')
    clients.forEach((c) => c.release(true)) // ends each
    await pool.end()
    await eventually(async () => (await proxy.stats()).idle === 2, 'two kept idle (--pool-size)')
    assert.equal((await backendsOf(app)).length, 2, 'the others closed')
    await eventually(async () => (await backendsOf(app)).length === 0, 'the idle ones closed after the idle timeout', 3000)
  } finally {
    await proxy.close()
  }
  // /sql holds as many backends per key at once as the pool keeps idle: none it gives back is closed.
  const sized = await startProxy({ size: 2 })
  try {
    const sql = sqlVia(sized, `${own.host}:${own.port}`)
    const pids = await Promise.all(Array.from({ length: 6 }, () => sql('SELECT pg_backend_pid() AS pid, pg_sleep(0.1)')))
    assert.equal(new Set(pids.map((r) => r.pid)).size, 2, '/sql on two backends')
    assert.equal((await sized.stats()).discards, 0, 'none closed for want of room')
  } finally {
    await sized.close()
  }
  // Without the pool, and for sessions whose login the proxy does not run (end-to-end authentication).
  for (const [what, unpooled] of [['--no-pool', await startProxy({ enabled: false })], ['end-to-end auth', await startProxy({}, { authOffload: false })]] as const) {
    try {
      const cfg = config(unpooled, 'scram_user', { application_name: 'edgepg-pool-unpooled' })
      const pids = [(await session(cfg)).pid, (await session(cfg)).pid]
      assert.notEqual(pids[0], pids[1], `${what}: a backend per session`)
      assert.deepEqual(await unpooled.stats(), { hits: 0, misses: 0, resets: 0, discards: 0, pooled: 0, idle: 0 }, what)
    } finally {
      await unpooled.close()
    }
  }
})

test('through PgBouncer (session mode) and over upstream TLS, warm backends work the same', async () => {
  const bouncer = await startPgBouncer(own, { pool_mode: 'session', max_client_conn: 20 })
  const certs = await generateCerts()
  const tlsPg = await startPostgres(tlsOnly(18, certs.server))
  try {
    for (const [what, upstream, upstreamTls] of [
      ['PgBouncer', `127.0.0.1:${bouncer.port}`, undefined],
      ['upstream TLS (verify-full)', `127.0.0.1:${tlsPg.port}`, { mode: 'verify-full' as const, ca: certs.ca.cert }],
    ] as const) {
      const proxy = await startProxy({}, { upstream, upstreamTls })
      try {
        const target = what === 'PgBouncer' ? own : tlsPg
        const cfg = { ...config(proxy, 'scram_user', { application_name: 'edgepg-pool-via' }), host: '127.0.0.1', port: Number(upstream.split(':')[1]), database: target.database }
        const direct = what !== 'PgBouncer'
        const first = await session(cfg, (c) => c.query('SET search_path TO pg_catalog'), direct)
        const second = await session(cfg, async (c) => (await c.query("SELECT current_setting('search_path') AS path, (SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()) AS ssl")).rows[0], direct)
        assert.equal(second.pid, first.pid, `${what}: the same backend`)
        assert.deepEqual(second.result, { path: '"$user", public', ssl: what !== 'PgBouncer' }, `${what}: reset, and on TLS where asked`)
        assert.equal((await proxy.stats()).hits, 1, `${what}: one warm session`)
      } finally {
        await proxy.close()
      }
    }
  } finally {
    await bouncer.stop()
    await tlsPg.stop()
    await certs.cleanup()
  }
})

test('the pool’s flags and environment variables reach the proxy’s options; bad values are refused', async () => {
  const { parseConfig } = await import('../proxy/config')
  const options = (argv: string[], env: Record<string, string> = {}) => (parseConfig(['--upstream', '127.0.0.1:5432', ...argv], env) as any).options.pool
  const lending = { mode: 'transaction', size: 20, timeoutMs: 5000, statements: 100, idleInTransactionMs: 60_000, listenBufferBytes: 1 << 20, listenPolicy: undefined, maxPerClient: undefined, maxPinned: undefined }
  assert.deepEqual(options([]), { enabled: true, maxBackends: 100, idleTimeoutMs: 60_000, maxLifetimeMs: 1_800_000, keepWarmMs: 3_600_000, ...lending })
  assert.deepEqual(options(['--no-pool', '--pool-size', '3', '--pool-max-backends', '7', '--pool-idle-timeout', '500', '--pool-max-lifetime', '9000', '--pool-keep-warm', '0']), {
    enabled: false, maxBackends: 7, idleTimeoutMs: 500, maxLifetimeMs: 9000, keepWarmMs: 0, ...lending, size: 3,
  })
  assert.deepEqual(options([], { EDGEPG_NO_POOL: 'true', EDGEPG_POOL_SIZE: '2', EDGEPG_POOL_MAX_LIFETIME: '1000', EDGEPG_POOL_KEEP_WARM: '5000' }), {
    enabled: false, maxBackends: 100, idleTimeoutMs: 60_000, maxLifetimeMs: 1000, keepWarmMs: 5000, ...lending, size: 2,
  })
  assert.deepEqual(options(['--pool-mode', 'transaction', '--pool-size', '5', '--pool-timeout', '300', '--pool-statements', '9']), {
    enabled: true, maxBackends: 100, idleTimeoutMs: 60_000, maxLifetimeMs: 1_800_000, keepWarmMs: 3_600_000, ...lending, size: 5, timeoutMs: 300, statements: 9,
  })
  // The shares of transaction pooling: by default a quarter of --pool-size (proxy/index.ts), here given.
  assert.deepEqual(options(['--max-backends-per-client', '6', '--max-pinned-sessions', '2', '--idle-in-transaction-timeout', '0']), {
    enabled: true, maxBackends: 100, idleTimeoutMs: 60_000, maxLifetimeMs: 1_800_000, keepWarmMs: 3_600_000, ...lending, maxPerClient: 6, maxPinned: 2, idleInTransactionMs: 0,
  })
  assert.equal(options([], { EDGEPG_MAX_PINNED_SESSIONS: '3' }).maxPinned, 3)
  assert.throws(() => options(['--max-backends-per-client', '0']), /--max-backends-per-client must be an integer ≥ 1, got "0"/)
  assert.equal(options([], { EDGEPG_POOL_MODE: 'session' }).mode, 'session')
  assert.throws(() => options(['--pool-mode', 'statement']), /--pool-mode must be session or transaction, not "statement"/)
  assert.throws(() => options(['--pool-idle-timeout', '0']), /--pool-idle-timeout must be a duration in ms or with a unit \(500ms, 5s, 2m, 1h\) ≥ 1, got "0"/)
  // The two caps --pool-size replaced (their mismatch made backends churn) say so.
  assert.throws(() => options(['--sql-pool-max', '32']), /--sql-pool-max was replaced by --pool-size \(EDGEPG_POOL_SIZE\)/)
  assert.throws(() => options([], { EDGEPG_POOL_MAX_IDLE_PER_KEY: '4' }), /EDGEPG_POOL_MAX_IDLE_PER_KEY was replaced by --pool-size/)
  assert.throws(() => options([], { EDGEPG_POOL_MAX_BACKENDS: 'many' }), /EDGEPG_POOL_MAX_BACKENDS must be an integer ≥ 0, got "many"/)
})
