/**
 * LISTEN through transaction pooling (issue 50): sessions hold no backend between statements, one
 * listening backend per key serves them all, and what a pg client sees is what it sees over TCP.
 * Against the real proxy and Postgres; NOTIFY is sent over TCP unless a session sends it.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import pg from 'pg'
import { Client } from '../src/index'
import { startProxy, edgeClient, edgeConfig, eventually, within, scratchTable } from './support/helpers'
import { PASSWORD } from './support/stack'
import { superuserUrl } from './support/tokens'
import { RawSession, offeredLogin, errorCode } from './support/raw-session'
import { queryMessage } from './support/protocol'

let scratch: Awaited<ReturnType<typeof scratchTable>>
before(async () => (scratch = await scratchTable('notify', 'x int')))
after(() => scratch?.drop())

const APP = 'edgepg-notify'
const txProxy = (size: number, extra: Parameters<typeof startProxy>[0] = {}) => startProxy({ pool: { mode: 'transaction', size, timeoutMs: 2000, maxPerClient: size }, ...extra })

type Heard = { processId: number; channel: string; payload?: string }

async function session(port: number): Promise<Client & { heard: Heard[] }> {
  const client = Object.assign(edgeClient(port, 'scram_user', { application_name: APP }), { heard: [] as Heard[] })
  client.on('error', () => {})
  client.on('notification', ({ processId, channel, payload }) => client.heard.push({ processId, channel, payload }))
  await client.connect()
  return client
}

/** The processID the client was told (pg keeps it, untyped). */
const pidOf = (c: Client) => (c as unknown as { processID: number }).processID

const notify = (channel: string, payload: string) => scratch.tcp.query('SELECT pg_notify($1, $2)', [channel, payload])
const heardOn = (c: { heard: Heard[] }, channel: string) => c.heard.filter((h) => h.channel === channel).map((h) => h.payload)
const hears = (c: { heard: Heard[] }, channel: string, payload: string) => eventually(() => heardOn(c, channel).includes(payload), `"${payload}" on ${channel}`, 3000, 5)

/** Backends Postgres holds: the sessions' (by application_name) and the proxy's listening ones. */
async function held(): Promise<{ sessions: number; listening: number }> {
  const { rows } = await scratch.tcp.query(
    "SELECT count(*) FILTER (WHERE application_name = $1)::int AS sessions, count(*) FILTER (WHERE application_name = 'edgepg-proxy listener: ' || $1)::int AS listening FROM pg_stat_activity WHERE backend_type = 'client backend'",
    [APP]
  )
  return rows[0]
}

test('sessions that LISTEN hold no backend: one pool backend serves them and their queries, one listening backend their channels', async () => {
  const p = await txProxy(1)
  const sessions = await Promise.all(Array.from({ length: 6 }, () => session(p.port)))
  try {
    for (const [i, s] of sessions.entries()) await s.query(`LISTEN notify_many_${i % 2}`)
    // With --pool-size 1, a listening session that kept its backend would starve the others: each runs.
    for (const s of sessions) assert.equal((await s.query('SELECT 1 AS one')).rows[0].one, 1)
    await notify('notify_many_0', 'zero')
    await notify('notify_many_1', 'one')
    for (const [i, s] of sessions.entries()) await hears(s, `notify_many_${i % 2}`, i % 2 ? 'one' : 'zero')
    for (const s of sessions) assert.equal(s.heard.length, 1, 'each heard its channel once, and nothing else')
    // (Logins made at once before the key had a lender each made a backend: all but one are closed.)
    await eventually(async () => JSON.stringify(await held()) === JSON.stringify({ sessions: 1, listening: 1 }), 'one pool backend, one listening')
  } finally {
    await Promise.all(sessions.map((s) => s.end()))
    await p.close()
  }
  await eventually(async () => (await held()).listening === 0, 'the listening backend closed with the last channel')
})

test('LISTEN takes effect when its transaction commits, not if it rolls back; UNLISTEN and UNLISTEN * when theirs does', async () => {
  const p = await txProxy(2)
  const a = await session(p.port)
  try {
    await a.query('BEGIN; LISTEN notify_rolled; ROLLBACK')
    await a.query('BEGIN')
    await a.query('LISTEN notify_committed')
    await a.query('COMMIT')
    // (Commit order: the second NOTIFY is heard, so the first would have been too.)
    await notify('notify_rolled', 'never')
    await notify('notify_committed', 'yes')
    await hears(a, 'notify_committed', 'yes')
    assert.deepEqual(heardOn(a, 'notify_rolled'), [])
    await a.query('LISTEN notify_other')
    await a.query('BEGIN; UNLISTEN notify_committed; ROLLBACK')
    await notify('notify_committed', 'still')
    await hears(a, 'notify_committed', 'still')
    await a.query('UNLISTEN notify_committed')
    await notify('notify_committed', 'gone')
    await notify('notify_other', 'marker 1')
    await hears(a, 'notify_other', 'marker 1')
    assert.deepEqual(heardOn(a, 'notify_committed'), ['yes', 'still'])
    await a.query('UNLISTEN *')
    await notify('notify_other', 'gone')
    await a.query('LISTEN notify_marker')
    await notify('notify_marker', 'marker 2')
    await hears(a, 'notify_marker', 'marker 2')
    assert.deepEqual(heardOn(a, 'notify_other'), ['marker 1'])
  } finally {
    await a.end()
    await p.close()
  }
})

test('every form a client may send: extended protocol, several in one string, quoted names with case, quotes and UTF-8', async () => {
  const p = await txProxy(2)
  const a = await session(p.port)
  const names = ['Mixed Case', 'with "quotes"', 'naïve ☃', 'notify_plain']
  try {
    await a.query({ name: 'listen-extended', text: 'LISTEN notify_extended' })
    await a.query(`LISTEN "Mixed Case"; LISTEN "with ""quotes"""; LISTEN "naïve ☃"; LISTEN notify_plain; LISTEN notify_dropped; UNLISTEN notify_dropped`)
    const channels = (await a.query('SELECT c FROM pg_listening_channels() c ORDER BY 1')).rows.map((r) => r.c)
    assert.deepEqual(channels, [...names, 'notify_extended'].sort())
    for (const name of [...names, 'notify_extended']) await notify(name, `to ${name}`)
    for (const name of [...names, 'notify_extended']) await hears(a, name, `to ${name}`)
    await notify('notify_dropped', 'no')
    await notify('notify_plain', 'marker')
    await hears(a, 'notify_plain', 'marker')
    assert.deepEqual(heardOn(a, 'notify_dropped'), [])
  } finally {
    await a.end()
    await p.close()
  }
})

test('no window: a NOTIFY committed once LISTEN has returned is heard, every time', async () => {
  const p = await txProxy(2)
  const a = await session(p.port)
  try {
    for (let i = 0; i < 30; i++) {
      await a.query(`LISTEN notify_window_${i}`)
      await notify(`notify_window_${i}`, 'first')
    }
    for (let i = 0; i < 30; i++) await hears(a, `notify_window_${i}`, 'first')
  } finally {
    await a.end()
    await p.close()
  }
})

test("pg_listening_channels() answers with the session's channels, on whichever backend it runs", async () => {
  const p = await txProxy(1)
  const [a, b] = [await session(p.port), await session(p.port)]
  try {
    await a.query('LISTEN notify_a')
    await b.query('LISTEN notify_b1; LISTEN notify_b2')
    const list = async (c: Client) => (await c.query('SELECT array_agg(c ORDER BY c) AS l FROM pg_listening_channels() c')).rows[0].l
    // (One backend, the two sessions on it in turn: each time it changes hands, the channels follow the session.)
    for (let i = 0; i < 3; i++) {
      assert.deepEqual(await list(a), ['notify_a'])
      assert.deepEqual(await list(b), ['notify_b1', 'notify_b2'])
    }
    const c = await session(p.port)
    assert.equal((await c.query('SELECT count(*)::int AS n FROM pg_listening_channels()')).rows[0].n, 0, 'a session that never listened')
    await c.end()
  } finally {
    await Promise.all([a.end(), b.end()])
    await p.close()
  }
})

test("a notification a session sent itself carries its own processID, before its NOTIFY returns; others' name no backend (0)", async () => {
  const p = await txProxy(2)
  const [a, b] = [await session(p.port), await session(p.port)]
  try {
    await a.query('LISTEN notify_self')
    await b.query('LISTEN notify_self')
    await a.query("NOTIFY notify_self, 'from a'")
    assert.deepEqual(a.heard, [{ processId: pidOf(a), channel: 'notify_self', payload: 'from a' }], 'heard as on a connection of its own: before the NOTIFY returned')
    await b.query("SELECT pg_notify('notify_self', 'from b')")
    assert.deepEqual(b.heard.at(-1), { processId: pidOf(b), channel: 'notify_self', payload: 'from b' })
    await notify('notify_self', 'from outside')
    await hears(a, 'notify_self', 'from outside')
    await hears(b, 'notify_self', 'from outside')
    assert.deepEqual(a.heard, [
      { processId: pidOf(a), channel: 'notify_self', payload: 'from a' },
      { processId: 0, channel: 'notify_self', payload: 'from b' },
      { processId: 0, channel: 'notify_self', payload: 'from outside' },
    ], "each once: the session's own, then others' naming no backend")
    assert.deepEqual(b.heard.map((h) => h.processId), [0, pidOf(b), 0])
  } finally {
    await Promise.all([a.end(), b.end()])
    await p.close()
  }
})

test('a session inside a transaction block hears nothing until the block ends, then all of it in order', async () => {
  const p = await txProxy(2)
  const [a, idle] = [await session(p.port), await session(p.port)]
  try {
    await a.query('LISTEN notify_block')
    await idle.query('LISTEN notify_block')
    await a.query('BEGIN')
    for (const n of ['1', '2', '3']) await notify('notify_block', n)
    await hears(idle, 'notify_block', '3') // (the hub has them all)
    await a.query('SELECT 1')
    assert.deepEqual(heardOn(a, 'notify_block'), [], 'nothing inside the block')
    await a.query('COMMIT')
    assert.deepEqual(heardOn(a, 'notify_block'), ['1', '2', '3'], 'all of it as the block ended')
  } finally {
    await Promise.all([a.end(), idle.end()])
    await p.close()
  }
})

test('the listening backend lost: every listening session is told at once (a WARNING notice, 08006), listens again on a new one, and hears what follows', async () => {
  const p = await txProxy(2)
  const sessions = await Promise.all(Array.from({ length: 3 }, () => session(p.port)))
  const notices = sessions.map(() => [] as { code?: string; message?: string; severity?: string }[])
  sessions.forEach((s, i) => s.on('notice', (n) => notices[i].push({ code: n.code, message: n.message, severity: n.severity })))
  try {
    for (const s of sessions) await s.query('LISTEN notify_lost')
    const quiet = await session(p.port)
    const { rows } = await scratch.tcp.query('SELECT pid FROM pg_stat_activity WHERE application_name = $1', [`edgepg-proxy listener: ${APP}`])
    assert.equal(rows.length, 1)
    await scratch.tcp.query('SELECT pg_terminate_backend($1)', [rows[0].pid])
    for (const n of notices) await eventually(() => n.some((x) => x.code === '08006'), 'the warning', 1000, 5)
    for (const n of notices) assert.match(n[0].message ?? "", /listening connection to Postgres .* was lost: notifications sent meanwhile were not delivered; LISTEN notify_lost is being registered again/)
    for (const n of notices) await eventually(() => n.some((x) => x.code === '00000'), 'listening again', 5000, 5)
    await notify('notify_lost', 'after')
    for (const s of sessions) await hears(s, 'notify_lost', 'after')
    assert.equal((await held()).listening, 1, 'one listening backend again')
    // The sessions were never closed: each runs on.
    for (const s of sessions) assert.equal((await s.query('SELECT 2 AS two')).rows[0].two, 2)
    assert.equal(quiet.listenerCount('notice'), 0)
    await quiet.end()
  } finally {
    await Promise.all(sessions.map((s) => s.end()))
    await p.close()
  }
})

test('a LISTEN run by database code (DO) keeps the session on its backend, which hears for it, as before', async () => {
  const p = await txProxy(2)
  const a = await session(p.port)
  try {
    await a.query(`DO $$ BEGIN EXECUTE 'LISTEN notify_do'; END $$`)
    // (Postgres's account comes behind the client's answer: counted a moment later.)
    const pins = async () => (await p.metrics.registry.getSingleMetric('edgepg_proxy_pinned_sessions_total')!.get()).values.filter((v) => v.value > 0).map((v) => `${v.labels.reason} ${v.value}`)
    await eventually(async () => (await pins()).join() === 'listen 1', 'pinned for it, once')
    await notify('notify_do', 'via its backend')
    await hears(a, 'notify_do', 'via its backend')
    assert.equal(a.heard.length, 1)
  } finally {
    await a.end()
    await p.close()
  }
})

test('once listening, a change by database code goes through the hub too: held until registered, each notification once', async () => {
  const p = await txProxy(1)
  const [a, b] = [await session(p.port), await session(p.port)]
  try {
    await a.query('LISTEN notify_first')
    await a.query(`DO $$ BEGIN EXECUTE 'LISTEN notify_by_code'; END $$`)
    await notify('notify_by_code', 'one')
    await notify('notify_first', 'two')
    await hears(a, 'notify_first', 'two')
    assert.deepEqual(a.heard.map((h) => h.payload), ['one', 'two'])
    assert.equal((await b.query('SELECT count(*)::int AS n FROM pg_listening_channels()')).rows[0].n, 0, 'the session keeps no backend: another runs on the one there is')
  } finally {
    await Promise.all([a.end(), b.end()])
    await p.close()
  }
})

test('a session too slow to take its notifications is closed with an error naming --listen-buffer; the others hear on', async () => {
  const p = await txProxy(2, { pool: { mode: 'transaction', size: 2, timeoutMs: 2000, listenBufferBytes: 64 << 10 } })
  const fast = await session(p.port)
  const slow = await RawSession.open(p.port, await offeredLogin((extra) => ((c) => c.connect().then(() => c))(edgeClient(p.port, 'scram_user', { application_name: APP, ...extra }))))
  try {
    await fast.query('LISTEN notify_flood')
    assert.equal((await slow.run(queryMessage('LISTEN notify_flood'))).outcome, 'ok')
    const socket = (slow as any).ws._socket as import('node:net').Socket
    socket.pause() // (it reads no more: the kernel's buffers fill, then the proxy's)
    const payload = 'x'.repeat(7000)
    let sent = 0
    for (; sent < 4000 && (await listening(p)) === 2; sent += 50) await scratch.tcp.query('SELECT pg_notify($1, $2 || g) FROM generate_series(1, 50) g', ['notify_flood', payload])
    await eventually(async () => (await listening(p)) === 1, 'the slow session dropped', 10_000)
    socket.resume() // (a client that reads again within the close's grace reads why, behind what it had not read)
    await eventually(() => (slow as any).closed, 'the slow one reads its close')
    await eventually(() => fast.heard.length === sent, `the fast one hears all ${sent}`, 10_000)
    const error = ((slow as any).messages as { type: string; body: Buffer }[]).find((m) => m.type === 'E')
    assert.ok(error, 'an ErrorResponse before the close')
    assert.equal(errorCode(error.body), '53400')
    assert.match(error.body.toString(), /fell \d+ bytes behind its notifications, over --listen-buffer \(65536\)/)
  } finally {
    await Promise.all([slow.end().catch(() => {}), fast.end()])
    await p.close()
  }
})

/** Sessions listening through the proxy (its gauge). */
async function listening(p: Awaited<ReturnType<typeof txProxy>>): Promise<number> {
  return (await p.metrics.registry.getSingleMetric('edgepg_proxy_listening_sessions')!.get()).values[0].value
}

test('a listening session is not idle: --idle-timeout closes the quiet session that does not listen, not the one that does', async () => {
  const p = await txProxy(2, { idleTimeoutMs: 200 })
  const [listening, quiet] = [await session(p.port), await session(p.port)]
  const ended = new Promise((resolve) => quiet.once('end', resolve))
  try {
    await listening.query('LISTEN notify_idle')
    await within(3000, 'the quiet session closed for idleness', ended)
    await new Promise((r) => setTimeout(r, 600)) // (three idle timeouts more, hearing nothing)
    await notify('notify_idle', 'still here')
    await hears(listening, 'notify_idle', 'still here')
  } finally {
    await listening.end()
    await p.close()
  }
})

test("a listening backend Postgres refuses (the role's connection limit): the LISTEN fails with Postgres's reason, the session goes on, and listens once it may", async () => {
  const role = `notify_limited_${process.pid}`
  const admin = new pg.Client(superuserUrl())
  await admin.connect()
  await admin.query(`CREATE ROLE ${role} LOGIN PASSWORD '${PASSWORD}' CONNECTION LIMIT 1`)
  const p = await txProxy(1)
  const c = Object.assign(new Client(edgeConfig(p.port, 'scram_user', { user: role, application_name: APP })), { heard: [] as Heard[] })
  c.on('notification', ({ processId, channel, payload }) => c.heard.push({ processId, channel, payload }))
  try {
    await c.connect()
    await assert.rejects(c.query('LISTEN notify_limited'), (err: Error & { code?: string }) => {
      assert.equal(err.code, '53300')
      assert.match(err.message, new RegExp(`could not listen on "notify_limited": too many connections for role "${role}"`))
      return true
    })
    assert.equal((await c.query('SELECT count(*)::int AS n FROM pg_listening_channels()')).rows[0].n, 0, 'not listening, on its backend either')
    await admin.query(`ALTER ROLE ${role} CONNECTION LIMIT 2`)
    await c.query('LISTEN notify_limited')
    await notify('notify_limited', 'now')
    await hears(c, 'notify_limited', 'now')
  } finally {
    await c.end().catch(() => {})
    await p.close()
    await eventually(async () => (await admin.query('SELECT count(*)::int AS n FROM pg_stat_activity WHERE usename = $1', [role])).rows[0].n === 0, 'its backends gone')
    await admin.query(`DROP ROLE ${role}`)
    await admin.end()
  }
})

test('the proxy closes its listening backend when it closes', async () => {
  const p = await txProxy(1)
  const a = await session(p.port)
  await a.query('LISTEN notify_close')
  assert.equal((await held()).listening, 1)
  await a.end()
  await p.close()
  await eventually(async () => (await held()).listening === 0, 'no listening backend')
})
