/**
 * `--workers n` (issue 23), with real processes: the CLI's primary and its workers accepting on one
 * port, WebSocket sessions and /sql alike; limits that hold for the proxy as a whole (a key's
 * backends at Postgres, sessions per client address); one /metrics for all; a worker killed with
 * SIGKILL replaced while the other's sessions go on; SIGTERM draining every worker.
 */
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import net from 'node:net'
import { readdirSync, readFileSync, readlinkSync } from 'node:fs'
import { availableParallelism } from 'node:os'
import { parseConfig } from '../proxy/config'
import { WebSocket } from 'ws'
import { startupMessage } from './support/protocol'
import { LOGIN_PREFIX, SUBPROTOCOL } from '../src/config'
import pg from 'pg'
import { Client } from '../src/index'
import { startChildProxy, type ChildProxy } from './support/child-proxy'
import { edgeConfig, eventually, pgConfig, testPostgres, within } from './support/helpers'
import { PASSWORD } from './support/stack'
import { sessionsByWorker } from './support/by-worker'

const APP = `edgepg-cluster-${process.pid}`

const listening = (p: ChildProxy) => p.lines.filter((l) => l.listening).map((l) => l.pid as number)

async function clusterProxy(flags: string[] = []) {
  const { host, port } = testPostgres()
  // (The CLI as the package ships it: npm test builds dist/ first.)
  const p = await startChildProxy(`${host}:${port}`, { built: true, env: { EDGEPG_WORKERS: '2' }, flags: ['--max-sessions-per-ip', '1000', '--max-backends-per-client', '1000', '--shutdown-grace', '2000', ...flags] })
  await eventually(() => new Set(listening(p)).size === 2, 'both workers listening', 15_000)
  return p
}

/** A session of `app`, its errors kept from the test's output. */
const appSession = (p: ChildProxy, app: string) => async () => {
  const c = new Client(edgeConfig(p.port, 'scram_user', { application_name: app }))
  c.on('error', () => {})
  await c.connect()
  return c
}

const session = (p: ChildProxy) => appSession(p, APP)()

/** A session, once the proxy has a place for it (one ended a moment ago may still hold its place). */
async function sessionOnceFree(p: ChildProxy) {
  let c: Client | undefined
  await eventually(async () => !!(c = await session(p).catch(() => undefined)), 'a place for a session')
  return c!
}

test('--workers 2: sessions and /sql on one port, one /metrics for the whole proxy, and a key never holds more than --pool-size backends at Postgres', async () => {
  const p = await clusterProxy(['--pool-size', '4', '--pool-timeout', '10000'])
  const watcher = new pg.Client(pgConfig('trust_user'))
  await watcher.connect()
  try {
    const clients = await Promise.all(Array.from({ length: 16 }, () => session(p)))
    let peak = 0
    let sampling = true
    const sampler = (async () => {
      for (; sampling; await new Promise((r) => setTimeout(r, 20))) {
        const { rows } = await watcher.query('SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = $1', [APP])
        peak = Math.max(peak, rows[0].n)
      }
    })()
    await Promise.all(clients.map((c, i) => c.query('SELECT pg_sleep(0.2), $1::int AS i', [i])))
    sampling = false
    await sampler
    assert.ok(peak > 0 && peak <= 4, `Postgres held ${peak} backends for the key, --pool-size 4`)
    const { host, port, database } = testPostgres()
    for (let i = 0; i < 4; i++) {
      const res = await fetch(`http://127.0.0.1:${p.port}/sql`, {
        method: 'POST',
        headers: { 'neon-connection-string': `postgres://scram_user:${PASSWORD}@${host}:${port}/${database}`, 'content-type': 'application/json' },
        body: JSON.stringify({ query: 'SELECT $1::int AS n', params: [i] }),
      })
      assert.equal(res.status, 200, await res.text())
    }
    await Promise.all(clients.map((c) => c.end()))
    // Sessions from both workers in one count: 16 (in whichever worker /metrics was answered by).
    await eventually(async () => {
      const text = await (await fetch(`http://127.0.0.1:${p.port}/metrics`)).text()
      return Number(/^edgepg_proxy_sessions_total\{[^}]*kind="ok"[^}]*\} (\d+)/m.exec(text)?.[1]) === 16
    }, 'the whole proxy’s sessions in /metrics')
    assert.deepEqual(new Set(p.logs.map((l) => l.worker)), new Set([0, 1]), 'both workers served sessions')
  } finally {
    await watcher.end()
    await p.stop()
  }
})

test("--workers 2, transaction pooling: a key's first login on one worker has the other log a backend of it in ahead of need; its logins on either worker then reach Postgres no more", async () => {
  const p = await clusterProxy(['--pool-mode', 'transaction'])
  const app = `${APP}-ahead`
  const watcher = new pg.Client(pgConfig('trust_user'))
  await watcher.connect()
  const backends = async () => (await watcher.query('SELECT array_agg(pid ORDER BY pid) AS pids FROM pg_stat_activity WHERE application_name = $1', [app])).rows[0].pids ?? []
  const once = async () => {
    const c = new Client(edgeConfig(p.port, 'scram_user', { application_name: app }))
    await c.connect()
    const { pid } = (await c.query('SELECT pg_backend_pid() AS pid')).rows[0]
    await c.end()
    return pid as number
  }
  try {
    const ended = p.logs.length
    await once()
    // Before any session of the key reaches the other worker, that worker has logged a backend in.
    await eventually(async () => (await backends()).length === 2, 'a backend of the key logged in by the other worker', 5000)
    const ahead: number[] = await backends()
    const served = () => new Set(p.logs.slice(ended).map((l) => l.worker))
    for (let i = 0; i < 40 && served().size < 2; i++) assert.ok(ahead.includes(await once()), 'a backend logged in ahead')
    await eventually(() => served().size === 2, 'sessions on both workers')
    assert.deepEqual(await backends(), ahead, 'no more logins at Postgres')
  } finally {
    await watcher.end()
    await p.stop()
  }
})

test("--workers 2, transaction pooling: the backends logged in ahead of need are their client's, held to its share of keys kept warm (--max-backends-per-client) on every worker", async () => {
  const p = await clusterProxy(['--pool-mode', 'transaction', '--pool-idle-timeout', '500', '--max-backends-per-client', '1'])
  const app = `${APP}-share`
  const watcher = new pg.Client(pgConfig('trust_user'))
  await watcher.connect()
  const backends = async () => (await watcher.query('SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name LIKE $1', [`${app}-%`])).rows[0].n as number
  try {
    for (let k = 0; k < 4; k++) {
      const c = new Client(edgeConfig(p.port, 'scram_user', { application_name: `${app}-${k}` }))
      await c.connect()
      await c.query('SELECT 1')
      await c.end()
    }
    await eventually(async () => (await backends()) >= 5, "each key's backend, and the other worker's logged in ahead", 5000)
    // Past the idle timeout, each worker keeps one of this client's keys warm: two in all.
    await eventually(async () => (await backends()) <= 2, "the client's share kept, on each worker", 10_000)
    await new Promise((r) => setTimeout(r, 1000))
    assert.equal(await backends(), 2, 'one kept on each worker')
  } finally {
    await watcher.end()
    await p.stop()
  }
})

test('--workers 2, transaction pooling: backends go to the worker whose sessions wait, logged in already (no login at Postgres), and back', async () => {
  // --pool-size 2: a backend on each worker. Without moves, a second session of one worker waits out --pool-timeout.
  const p = await clusterProxy(['--pool-mode', 'transaction', '--pool-size', '2', '--pool-timeout', '4000'])
  const app = `${APP}-moves`
  const watcher = new pg.Client(pgConfig('trust_user'))
  await watcher.connect()
  const backends = async () => (await watcher.query('SELECT array_agg(pid ORDER BY pid) AS pids FROM pg_stat_activity WHERE application_name = $1', [app])).rows[0].pids ?? []
  const pidOf = async (c: Client) => (await c.query('SELECT pg_backend_pid() AS pid')).rows[0].pid as number
  const all: Client[] = []
  try {
    const by = await sessionsByWorker(appSession(p, app), (by) => by.some((w) => w.length >= 2) && by.every((w) => w.length >= 1))
    all.push(...by.flat())
    await pidOf(all[0])
    await eventually(async () => (await backends()).length === 2, "the key's backend on each worker", 5000)
    const logged = await backends()
    const w = by[0].length >= 2 ? 0 : 1
    const [a, b] = by[w]
    const c = by[1 - w][0]
    await c.query("SET search_path TO c_own_schema, public") // (on the other worker's backend, which c then leaves parked)
    await a.query('BEGIN')
    const pidA = await pidOf(a) // (worker w's one backend, held)
    const pidB = await pidOf(b) // (the other worker's, handed over)
    assert.ok(logged.includes(pidB) && pidB !== pidA, `b ran on the other worker's backend: ${pidB}, a on ${pidA}, logged in ${logged}`)
    assert.equal((await b.query('SHOW search_path')).rows[0].search_path, '"$user", public', "nothing of c's came with the backend")
    // And back: the other worker's session finds none there; b's, idle now, goes back to it, c's setting with c.
    assert.equal(await pidOf(c), pidB)
    assert.equal((await c.query('SHOW search_path')).rows[0].search_path, 'c_own_schema, public')
    await a.query('COMMIT')
    for (const s of [a, b, c, a]) assert.ok(logged.includes(await pidOf(s)))
    assert.deepEqual(await backends(), logged, 'no login at Postgres: the same two backends')
  } finally {
    await Promise.all(all.map((c) => c.end().catch(() => {})))
    await watcher.end()
    await p.stop()
  }
})

test('--workers 2, transaction pooling: a backend its session left inside a transaction goes, once reset, to the worker whose sessions wait', async () => {
  // --pool-size 2: a backend on each worker, both held inside transactions; the second session on
  // one worker waits, and the other worker's backend comes free only through its reset.
  const p = await clusterProxy(['--pool-mode', 'transaction', '--pool-size', '2', '--pool-timeout', '4000'])
  const all: Client[] = []
  try {
    const by = await sessionsByWorker(appSession(p, `${APP}-reset`), (by) => by.some((w) => w.length >= 2) && by.every((w) => w.length >= 1))
    all.push(...by.flat())
    const w = by[0].length >= 2 ? 0 : 1
    const [b1, b2] = by[w]
    const a = by[1 - w][0]
    await b1.query('BEGIN')
    await a.query('BEGIN')
    const waits = b2.query('SELECT 5 AS n')
    await new Promise((r) => setTimeout(r, 300)) // (b2's worker has asked, and the other had none to spare)
    await a.end() // (its backend is rolled back and reset)
    assert.deepEqual((await within(6000, "b2's statement", waits)).rows, [{ n: 5 }])
  } finally {
    await Promise.all(all.map((c) => c.end().catch(() => {})))
    await p.stop()
  }
})

test('--workers 2, transaction pooling: while backends move back and forth, every statement of sessions that come and go at once is answered', async () => {
  // Twenty sessions on five backends, each opened, queried and ended at once, round after round: the
  // workers' lines fill and empty together, so backends travel both ways, lent and idle.
  const p = await clusterProxy(['--pool-mode', 'transaction', '--pool-size', '5', '--pool-timeout', '8000'])
  try {
    for (let round = 0; round < 40; round++) {
      const answered = Promise.all(
        Array.from({ length: 20 }, async (_, i) => {
          const c = await appSession(p, `${APP}-churn`)()
          try {
            return (await c.query('SELECT $1::int AS n', [round * 100 + i])).rows[0].n
          } finally {
            await c.end()
          }
        })
      )
      const ns = await within(6000, `round ${round}: twenty sessions' statements answered`, answered)
      assert.deepEqual(ns, Array.from({ length: 20 }, (_, i) => round * 100 + i))
    }
    // None was closed on the way: each moved whole, and each worker kept what it held.
    const text = await (await fetch(`http://127.0.0.1:${p.port}/metrics`)).text()
    assert.equal(/^edgepg_proxy_pool_discards_total (\d+)$/m.exec(text)?.[1], '0')
  } finally {
    await p.stop()
  }
})

test('--workers 2, transaction pooling: --max-pinned-sessions counts the pinned sessions of every worker, wherever they are', async () => {
  // Two may be pinned in all: both on one worker, while a session there still runs on a backend from the other; a third is closed.
  const p = await clusterProxy(['--pool-mode', 'transaction', '--pool-size', '4', '--max-pinned-sessions', '2', '--pool-timeout', '4000'])
  const app = `${APP}-pins`
  const all: Client[] = []
  try {
    const by = await sessionsByWorker(appSession(p, app), (by) => by.some((w) => w.length >= 3) && by.every((w) => w.length >= 1))
    all.push(...by.flat())
    const w = by[0].length >= 3 ? 0 : 1
    const [a, b, d] = by[w]
    for (const [i, s] of [a, b].entries()) await s.query(`CREATE TEMP TABLE kept (i int); INSERT INTO kept VALUES (${i})`)
    assert.deepEqual((await d.query('SELECT 7 AS n')).rows, [{ n: 7 }], "a third session of that worker runs, on the other's backend")
    for (const [i, s] of [a, b].entries()) assert.deepEqual((await s.query('SELECT i FROM kept')).rows, [{ i }], 'each pinned session keeps its table')
    const closed = new Promise<Error>((resolve) => by[1 - w][0].once('error', resolve))
    await by[1 - w][0].query('CREATE TEMP TABLE kept (i int)').catch(() => {})
    assert.match((await within(5000, 'the third pinned session closed', closed)).message, /2 sessions of this user and database already keep theirs \(--max-pinned-sessions\)/)
  } finally {
    await Promise.all(all.map((c) => c.end().catch(() => {})))
    await p.stop()
  }
})

test('--workers 2: --max-sessions-per-ip counts the sessions of every worker', async () => {
  const p = await clusterProxy(['--max-sessions-per-ip', '3'])
  try {
    const clients = await Promise.all(Array.from({ length: 3 }, () => session(p)))
    for (let i = 0; i < 4; i++) await assert.rejects(session(p), /429|too many sessions from/, 'a fourth, on either worker')
    await clients[0].end()
    await Promise.all([await sessionOnceFree(p), ...clients.slice(1)].map((c) => c.end()))
  } finally {
    await p.stop()
  }
})

test('--workers 2: a client address may hold its whole limit wherever the kernel sends its connections, sessions and /sql alike', async () => {
  // Each worker may hold its share of a limit without asking (2 and 1 of 3 here); past it, the primary
  // has the other hand back what it does not use. Split limits would refuse whenever the kernel
  // sends more than a share's worth to one worker.
  const p = await clusterProxy(['--max-sessions-per-ip', '3', '--sql-max-requests-per-ip', '3'])
  const { host, port, database } = testPostgres()
  const LOCK = 230_000 + (process.pid % 10_000)
  const holder = new pg.Client(pgConfig('trust_user'))
  await holder.connect()
  const sql = (query: string) =>
    fetch(`http://127.0.0.1:${p.port}/sql`, {
      method: 'POST',
      headers: { 'neon-connection-string': `postgres://scram_user:${PASSWORD}@${host}:${port}/${database}`, 'content-type': 'application/json', connection: 'close' },
      body: JSON.stringify({ query, params: [] }),
    })
  try {
    for (let round = 0; round < 6; round++) {
      const clients: Client[] = []
      // (A place comes back once the proxy has seen the last round's session close.)
      for (let i = 0; i < 3; i++) clients.push(await sessionOnceFree(p))
      await assert.rejects(session(p), /429|too many sessions from/)
      await Promise.all(clients.map((c) => c.end()))
      // Three /sql requests in flight at once (each on its own connection, waiting on a lock the test
      // holds), and a fourth refused.
      await holder.query('SELECT pg_advisory_lock($1)', [LOCK])
      const waiting = [0, 1, 2].map(() => sql(`SELECT pg_advisory_xact_lock(${LOCK})`))
      await eventually(async () => {
        const { rows } = await holder.query(`SELECT count(*)::int AS n FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = $1`, [LOCK])
        return rows[0].n === 3
      }, 'three requests waiting on the lock')
      assert.equal((await sql('SELECT 1')).status, 429, 'a fourth request, while three run')
      await holder.query('SELECT pg_advisory_unlock($1)', [LOCK])
      assert.deepEqual(await Promise.all(waiting.map(async (r) => (await r).status)), [200, 200, 200])
      // Places come back as sessions and requests end (a worker tells the primary).
      await eventually(async () => (await sql('SELECT 1')).status === 200, 'a request again')
    }
    const served = new Set(p.logs.map((l) => l.worker))
    assert.deepEqual(served, new Set([0, 1]), 'both workers served')
  } finally {
    await holder.end()
    await p.stop()
  }
})

test('--workers 2: a worker killed with SIGKILL is replaced; the sessions on the other lose nothing; SIGTERM drains them all', async () => {
  // (Each worker keeps half the pool: enough for every session to hold a transaction, wherever it lands.)
  const p = await clusterProxy(['--pool-size', '48'])
  const table = `cluster_kill_${process.pid}`
  const admin = new pg.Client(pgConfig('trust_user'))
  await admin.connect()
  await admin.query(`DROP TABLE IF EXISTS ${table}; CREATE TABLE ${table} (i int); GRANT ALL ON ${table} TO scram_user`)
  try {
    // (Many at once, so that the kernel, which hands each connection to one worker, gives both some.)
    const clients = await Promise.all(Array.from({ length: 24 }, () => session(p)))
    // Each in a transaction that has written, when the worker dies.
    for (const [i, c] of clients.entries()) await c.query(`BEGIN; INSERT INTO ${table} VALUES (${i})`)
    const pids = listening(p)
    const victim = pids[0]
    const onVictim = clients.map((c) => ownerOf(p.port, (c as any).connection.stream.ws._socket.localPort, pids) === victim)
    assert.ok(onVictim.includes(true) && onVictim.includes(false), `sessions on both workers: ${onVictim}`)
    process.kill(victim, 'SIGKILL')
    await eventually(() => p.lines.some((l) => l.exited?.pid === victim && l.replacedBy), 'the worker replaced', 15_000)
    await eventually(() => new Set(listening(p)).size === 3, 'the new worker listening', 15_000)
    // Those on the killed worker failed (their WebSocket went with it); every one on the other commits.
    const committed = await Promise.all(clients.map((c) => c.query('COMMIT').then(() => true, () => false)))
    assert.deepEqual(committed, onVictim.map((v) => !v), 'committed: exactly the sessions on the worker that lives')
    const { rows } = await admin.query(`SELECT i FROM ${table} ORDER BY i`)
    assert.deepEqual(rows.map((r) => r.i), [...clients.keys()].filter((i) => !onVictim[i]), 'their rows, and no other')
    const fresh = await Promise.all(Array.from({ length: 4 }, () => session(p)))
    for (const c of fresh) assert.deepEqual((await c.query('SELECT 2 AS two')).rows, [{ two: 2 }])
    const exited = new Promise<number | null>((resolve) => p.child.once('exit', resolve))
    p.child.kill('SIGTERM')
    assert.equal(await within(10_000, 'the proxy to drain and exit', exited), 0)
    await Promise.all([...clients, ...fresh].map((c) => c.end().catch(() => {})))
  } finally {
    await admin.query(`DROP TABLE IF EXISTS ${table}`)
    await admin.end()
    await p.stop()
  }
})

test('--workers 2, transaction pooling: one listening backend for the whole proxy; sessions on both workers hear each notification once, are told when it is lost, and a killed worker gives up its channels', async () => {
  const p = await clusterProxy(['--pool-mode', 'transaction'])
  const app = `${APP}-listen`
  const channel = `cluster_listen_${process.pid}`
  const admin = new pg.Client(pgConfig('trust_user'))
  await admin.connect()
  const listeners = async () => (await admin.query("SELECT array_agg(pid) AS pids FROM pg_stat_activity WHERE application_name = 'edgepg-proxy listener: ' || $1", [app])).rows[0].pids ?? []
  type Heard = Client & { heard: string[]; notices: string[] }
  const by = (await sessionsByWorker(appSession(p, app), (w) => w[0].length >= 2 && w[1].length >= 2)) as Heard[][]
  const all = by.flat()
  const allHear = (payload: string, who = all) => eventually(() => who.every((c) => c.heard.includes(payload)), `"${payload}" heard by all`, 5000)
  try {
    for (const c of all) {
      Object.assign(c, { heard: [], notices: [] })
      c.on('notification', (n) => c.heard.push(n.payload!))
      c.on('notice', (n) => c.notices.push(n.code!))
      await c.query(`LISTEN ${channel}`)
    }
    assert.equal((await listeners()).length, 1, 'one listening backend for both workers')
    await admin.query('SELECT pg_notify($1, $2), pg_notify($1, $3)', [channel, 'one', 'two'])
    await allHear('two')
    // Lost: every session on either worker is told, and hears again, through one new backend.
    const [lost] = await listeners()
    await admin.query('SELECT pg_terminate_backend($1)', [lost])
    await eventually(() => all.every((c) => c.notices.includes('08006') && c.notices.includes('00000')), 'every session told, then listening again', 5000)
    await admin.query('SELECT pg_notify($1, $2)', [channel, 'three'])
    await allHear('three')
    const [again] = await listeners()
    assert.ok(again !== undefined && again !== lost, 'a new listening backend')
    // A worker killed: the sessions on the other hear on; once they end, nothing of the dead one's is listened for.
    const pids = listening(p)
    const victim = ownerOf(p.port, (by[0][0] as any).connection.stream.ws._socket.localPort, pids)
    const survivors = all.filter((c) => ownerOf(p.port, (c as any).connection.stream.ws._socket.localPort, pids) !== victim)
    assert.ok(survivors.length >= 2 && survivors.length < all.length, `sessions on both workers: ${survivors.length} of ${all.length} survive`)
    process.kill(victim!, 'SIGKILL')
    await eventually(() => p.lines.some((l) => l.exited?.pid === victim), 'the worker gone', 15_000)
    await admin.query('SELECT pg_notify($1, $2)', [channel, 'four'])
    await allHear('four', survivors)
    for (const c of all) assert.deepEqual(c.heard, survivors.includes(c) ? ['one', 'two', 'three', 'four'] : ['one', 'two', 'three'], 'each notification once, in order')
    assert.deepEqual(await listeners(), [again], 'the same listening backend')
    await Promise.all(survivors.map((c) => c.end()))
    await eventually(async () => (await listeners()).length === 0, 'the listening backend closed with the last channel', 5000)
  } finally {
    await Promise.all(all.map((c) => c.end().catch(() => {})))
    await admin.end()
    await p.stop()
  }
})

/** Which of `pids` holds the proxy's side of the TCP connection from the client's `clientPort` (Linux /proc). */
function ownerOf(serverPort: number, clientPort: number | undefined, pids: number[]): number | undefined {
  if (!clientPort) return undefined // (not connected yet: port 0 would name the listening socket, which every worker shares)
  const hex = (n: number) => n.toString(16).toUpperCase().padStart(4, '0')
  for (const file of ['/proc/net/tcp', '/proc/net/tcp6']) {
    for (const line of readFileSync(file, 'utf8').split('\n').slice(1)) {
      const f = line.trim().split(/\s+/)
      if (f.length < 10 || f[1].split(':')[1] !== hex(serverPort) || f[2].split(':')[1] !== hex(clientPort)) continue
      const socket = `socket:[${f[9]}]`
      return pids.find((pid) => readdirSync(`/proc/${pid}/fd`).some((fd) => readlinkSync(`/proc/${pid}/fd/${fd}`, { encoding: 'utf8' }) === socket))
    }
  }
}

test('--workers 2: --max-logins-per-ip 1 holds for the whole proxy: one stalled login at Postgres, whichever worker the others reach', async () => {
  // Logins that never answer Postgres's authentication request (application_name STALLED), from
  // 127.0.0.2, counted at a relay in front of Postgres while their connections are open.
  const STALLED = `edgepg-stalled-${process.pid}`
  const { host, port, database } = testPostgres()
  let stalled = 0
  let peak = 0
  const relay = net.createServer((client) => {
    const upstream = net.connect(port, host)
    client.once('data', (startup) => {
      if (!startup.includes(STALLED)) return
      stalled++
      client.once('close', () => stalled--)
    })
    client.pipe(upstream).pipe(client)
    const gone = () => (client.destroy(), upstream.destroy())
    client.once('close', gone)
    upstream.once('close', gone)
    client.on('error', () => {})
    upstream.on('error', () => {})
  })
  await new Promise<void>((resolve) => relay.listen(0, '127.0.0.1', resolve))
  const sampler = setInterval(() => (peak = Math.max(peak, stalled)), 5)
  const p = await startChildProxy(`127.0.0.1:${(relay.address() as net.AddressInfo).port}`, {
    built: true,
    env: { EDGEPG_WORKERS: '2' },
    // (Session mode: in transaction mode a key's logins wait for its first, and never reach the limit.)
    flags: ['--max-logins-per-ip', '1', '--max-sessions-per-ip', '1000', '--handshake-timeout', '20000', '--pool-mode', 'session'],
  })
  const sockets: WebSocket[] = []
  let busy = true
  try {
    await eventually(() => new Set(listening(p)).size === 2, 'both workers listening', 15_000)
    // Sessions from 127.0.0.1 meanwhile: an idle worker takes every new connection, a busy one leaves some to the other.
    const load = Promise.all(Array.from({ length: 4 }, async () => {
      while (busy) await (await session(p)).end()
    }))
    const pids = listening(p)
    const owners = new Set<number>()
    const startup = startupMessage({ user: 'scram_user', database, application_name: STALLED }).toString('base64url')
    for (let i = 0; i < 200 && owners.size < 2; i++) {
      const ws = new WebSocket(p.url, [SUBPROTOCOL, LOGIN_PREFIX + startup], { localAddress: '127.0.0.2' })
      ws.on('error', () => {}) // (terminated before its upgrade is answered)
      sockets.push(ws)
      let owner: number | undefined
      // (Its upgrade is answered, and Postgres's request for a password relayed: ws moved the socket.)
      await eventually(() => (owner = ownerOf(p.port, ((ws as any)._socket ?? (ws as any)._req?.socket)?.localPort, pids)) !== undefined, 'the proxy to accept it')
      owners.add(owner!)
    }
    busy = false
    await load
    assert.equal(owners.size, 2, 'stalled logins on both workers')
    await eventually(() => stalled > 0, 'a stalled login at Postgres')
    await new Promise((r) => setTimeout(r, 500)) // the others, on either worker, waiting their turn
    assert.equal(peak, 1, 'Postgres had one stalled login from the proxy at a time')
  } finally {
    busy = false
    clearInterval(sampler)
    for (const ws of sockets) ws.terminate()
    await p.stop()
    relay.close()
  }
})

test('--workers defaults to the machine\'s cores, but never more than --pool-size can be split between (a big machine starts with the defaults)', () => {
  const workers = (...argv: string[]) => (parseConfig(['--upstream', '127.0.0.1:5432', ...argv], {}) as Exclude<ReturnType<typeof parseConfig>, 'help'>).workers
  assert.equal(workers(), Math.min(availableParallelism(), 20))
  assert.equal(workers('--pool-size', '1'), 1, 'more cores than --pool-size: as many workers as it allows')
  assert.throws(() => workers('--workers', '2', '--pool-size', '1'), /--pool-size \(1\) must be at least --workers \(2\)/, 'asked for explicitly: refused')
})

test('--workers 2 on a port already taken: the workers cannot listen, and the proxy exits 2 saying so (no respawning)', async () => {
  const taken = net.createServer()
  await new Promise<void>((resolve) => taken.listen(0, '127.0.0.1', resolve))
  const port = (taken.address() as net.AddressInfo).port
  try {
    const { host, port: pgPort } = testPostgres()
    const child = spawn(process.execPath, ['dist/cli.mjs', '--upstream', `${host}:${pgPort}`, '--listen', `127.0.0.1:${port}`, '--workers', '2'], { stdio: ['ignore', 'pipe', 'pipe'] })
    let out = ''
    child.stdout!.on('data', (d) => (out += d))
    child.stderr!.on('data', (d) => (out += d))
    const code = await within(20_000, 'the proxy to give up', new Promise((resolve) => child.once('exit', resolve)))
    assert.equal(code, 2, out)
    assert.match(out, /cannot listen on 127\.0\.0\.1:\d+: \w+ EADDRINUSE/)
    assert.ok((out.match(/"replacedBy"/g) ?? []).length === 0, `no worker was replaced: ${out}`)
  } finally {
    taken.close()
  }
})
