/**
 * Reads on a real streaming replica (--replica): a primary of this file's own, and a hot standby
 * made from it by the low-level backup API (test/support/standby.ts). Where a statement ran is what
 * Postgres says of itself (pg_is_in_recovery()); what a read returns is checked against what was
 * written, with the standby made to lag on purpose (recovery_min_apply_delay).
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { promisify } from 'node:util'
import { Readable } from 'node:stream'
import { pipeline } from 'node:stream/promises'
import { from as copyFrom } from 'pg-copy-streams'
import { WebSocket } from 'ws'
import pg from 'pg'
import { Client, Pool, config, httpSql } from '../src/index'
import { lsn } from '../proxy/replicas/positions'
import { startPostgres, PASSWORD, type Postgres } from './support/stack'
import { replicable, startStandby, type Standby } from './support/standby'
import { startProxy } from './support/helpers'
import { prng } from './support/prng'
import { errorCode, offeredLogin, RawSession } from './support/raw-session'
import { startDelayRelay, startHoldingRelay } from './support/delay-relay'
import { claimsAttacks, token, tokenFixture } from './support/tokens'
import { readOnlyLogin, serializableLogin, type ReplicaOptions } from '../proxy/replicas/replicas'
import { serialize } from 'pg-protocol'
import { SUBPROTOCOL_POSITIONS, positionMessage } from '../src/config'

let primary: Postgres
let standby: Standby
let admin: pg.Client
type Proxy = Awaited<ReturnType<typeof startProxy>>
const proxies: Proxy[] = []

before(async () => {
  primary = await startPostgres(replicable({ name: 'replicas-primary' }))
  standby = await startStandby(primary, 'replicas-standby')
  admin = primary.admin()
  await admin.connect()
  await admin.query('CREATE TABLE notes (id serial PRIMARY KEY, body text)')
  await admin.query('CREATE SEQUENCE counter')
  await standby.caughtUp()
})

after(async () => {
  for (const p of proxies) await p.close()
  await admin?.end()
  await standby?.stop()
  await primary?.stop()
})

async function proxyWith(replicas: Partial<ReplicaOptions> = {}, extra: Parameters<typeof startProxy>[0] = {}) {
  const p = await startProxy({
    upstream: `127.0.0.1:${primary.port}`,
    replicas: { addresses: [`127.0.0.1:${standby.port}`], maxLagMs: 5000, waitMs: 3000, autocommit: true, ...replicas },
    ...extra,
  })
  proxies.push(p)
  return p
}

const clientConfig = (p: Proxy, extra: object = {}) => ({
  host: '127.0.0.1', port: primary.port, user: 'scram_user', password: PASSWORD, database: 'postgres',
  webSocketConstructor: WebSocket as any, wsProxy: () => `ws://127.0.0.1:${p.port}/v2`, ...extra,
})
const sqlVia = (p: Proxy) => httpSql(`postgresql://scram_user:${PASSWORD}@127.0.0.1:${primary.port}/postgres`, { fetchEndpoint: `http://127.0.0.1:${p.port}/sql`, fullResults: true })

/** Whether the statement ran on the standby, by Postgres's own word. */
const where = async (c: Client | Pool) => ((await c.query('SELECT pg_is_in_recovery() AS standby')).rows[0].standby ? 'replica' : 'primary')

async function metric(p: Proxy, name: string, labels = ''): Promise<number> {
  const text = await p.metrics.registry.metrics()
  const line = text.split('\n').find((l) => l.startsWith(`edgepg_proxy_${name}${labels ? `{${labels}}` : ''} `))
  return line ? Number(line.split(' ')[1]) : NaN
}

const primaryLsn = async () => (await admin.query('SELECT pg_current_wal_insert_lsn()::text AS lsn')).rows[0].lsn as string

test('routing: autocommit reads and transactions begun read-only on the replica; writes, read-write transactions, session state and named statements on the primary', async () => {
  const p = await proxyWith()
  const c = new Client(clientConfig(p))
  await c.connect()
  try {
    assert.equal(await where(c), 'replica')
    await c.query('INSERT INTO notes (body) VALUES ($1)', ['routing'])
    await c.query('BEGIN READ ONLY')
    assert.equal(await where(c), 'replica')
    await c.query('COMMIT')
    await c.query('START TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY')
    assert.equal(await where(c), 'replica')
    await c.query('COMMIT')
    // A standby cannot serialize: SERIALIZABLE READ ONLY stays on the primary.
    await c.query('BEGIN ISOLATION LEVEL SERIALIZABLE READ ONLY')
    assert.equal(await where(c), 'primary')
    await c.query('COMMIT')
    await c.query('BEGIN')
    assert.equal(await where(c), 'primary', 'a read inside a read-write transaction')
    await c.query('INSERT INTO notes (body) VALUES ($1)', ['in a transaction'])
    assert.equal(await where(c), 'primary')
    await c.query('COMMIT')
    assert.equal((await c.query({ name: 'named', text: 'SELECT pg_is_in_recovery() AS standby' })).rows[0].standby, false, 'a named statement')
    assert.equal(await where(c), 'replica')
    // Session state is the primary's, and the session keeps to it from then on.
    await c.query(`SELECT set_config('edgepg.test', 'x', false)`)
    assert.equal(await where(c), 'primary')
    assert.equal((await c.query(`SELECT current_setting('edgepg.test') AS v`)).rows[0].v, 'x')
  } finally {
    await c.end()
  }
  const pool = new Pool(clientConfig(p, { options: '-c default_transaction_read_only=on' }))
  try {
    assert.equal(await where(pool), 'replica', 'a session whose transactions all start read-only')
    const r = await pool.query('SELECT count(*)::int AS n FROM notes')
    assert.ok(r.rows[0].n >= 2)
  } finally {
    await pool.end()
  }
  assert.ok((await metric(p, 'transactions_total', 'target="replica"')) >= 5)
  assert.ok((await metric(p, 'transactions_total', 'target="primary"')) >= 5)
})

test('a statement the standby refuses as a write (25006) runs on the primary instead, once, and the client never sees the refusal', async () => {
  const p = await proxyWith()
  const c = new Client(clientConfig(p))
  await c.connect()
  try {
    const { last_value, is_called } = (await admin.query('SELECT last_value::int, is_called FROM counter')).rows[0]
    const r = await c.query(`SELECT nextval('counter')::int AS n, pg_is_in_recovery() AS standby`)
    assert.deepEqual(r.rows[0], { n: is_called ? last_value + 1 : last_value, standby: false })
    // Data-modifying WITH reads as a SELECT to the parser: the standby says otherwise.
    const tag = `cte ${Date.now()}`
    const w = await c.query(`WITH made AS (INSERT INTO notes (body) VALUES ($1) RETURNING id) SELECT count(*)::int AS n FROM made`, [tag])
    assert.equal(w.rows[0].n, 1)
    assert.equal((await admin.query('SELECT count(*)::int AS n FROM notes WHERE body = $1', [tag])).rows[0].n, 1, 'written once')
    assert.equal(await where(c), 'replica', 'the next read goes to the replica again')
  } finally {
    await c.end()
  }
  assert.equal(await metric(p, 'replica_fallbacks_total', 'reason="read_only"'), 2)
})

test("a read moved off the replica leaves its backend there only once Postgres has answered the proxy's own messages: the next read on it gets its own answers", async () => {
  // The standby's answer to the light verification riding behind the refused read (DISCARD SEQUENCES leads it) comes 300 ms
  // late, and its answer to the reset of the backend that read leaves (DISCARD ALL) 300 ms after that.
  const relay = await startHoldingRelay({ host: '127.0.0.1', port: standby.port }, (type, body) => (type === 'C' && /DISCARD (SEQUENCES|ALL)/.test(body.toString()) ? 300 : 0))
  const p = await proxyWith({ addresses: [`127.0.0.1:${relay.port}`] }, { pool: { mode: 'transaction', size: 1 } })
  const c = new Client(clientConfig(p))
  await c.connect()
  try {
    assert.equal((await c.query(`SELECT nextval('counter') > 0 AS ok, pg_is_in_recovery() AS standby`)).rows[0].standby, false)
    const r = await c.query(`SELECT pg_is_in_recovery() AS standby, 'mine' AS x`)
    assert.deepEqual(r.rows, [{ standby: true, x: 'mine' }])
    assert.deepEqual(await c.query(`SELECT 'next' AS x`).then((r) => r.rows), [{ x: 'next' }])
    assert.equal(await metric(p, 'replica_fallbacks_total', 'reason="read_only"'), 1)
    assert.equal(await metric(p, 'replica_fallbacks_total', 'reason="check_failed"'), 0)
  } finally {
    await c.end()
    await relay.close()
  }
})

test("a read whose code leaves state on a replica's backend (a view calling a function that PREPAREs, sets search_path, seeds random()): reset before another session runs there; the session reads on", async () => {
  await admin.query(`CREATE FUNCTION replica_prepare() RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN EXECUTE 'PREPARE replica_left AS SELECT 1'; PERFORM set_config('search_path', 'pg_temp, public', false); PERFORM setseed(0.42); RETURN pg_is_in_recovery(); END $$`)
  await admin.query('CREATE VIEW replica_preparing AS SELECT replica_prepare() AS prepared_on_standby')
  await standby.caughtUp()
  try {
    const p = await proxyWith({}, { pool: { mode: 'transaction', size: 1 } })
    const [c, d] = [new Client(clientConfig(p)), new Client(clientConfig(p))]
    await Promise.all([c.connect(), d.connect()])
    const look = "SELECT pg_backend_pid() AS pid, pg_is_in_recovery() AS standby, current_setting('search_path') AS sp, (SELECT count(*)::int FROM pg_prepared_statements WHERE name = 'replica_left') AS left"
    const fresh = (await d.query(look)).rows[0]
    assert.equal(fresh.standby, true)
    assert.deepEqual((await c.query('SELECT prepared_on_standby FROM replica_preparing')).rows, [{ prepared_on_standby: true }], 'it ran on the replica')
    assert.deepEqual((await d.query(look)).rows[0], fresh, "d on the same replica backend: nothing of c's")
    await admin.query('SELECT setseed(0.42)')
    const seeded = (await admin.query('SELECT random() AS r')).rows[0].r
    const drawn = (await d.query('SELECT random() AS r, pg_backend_pid() AS pid, pg_is_in_recovery() AS standby')).rows[0]
    assert.deepEqual([drawn.pid, drawn.standby], [fresh.pid, true])
    assert.notEqual(drawn.r, seeded, "d draws from a fresh seed, not the one c's read left")
    assert.equal(await where(c), 'replica', 'c reads on')
    await Promise.all([c.end(), d.end()])
  } finally {
    await admin.query('DROP VIEW replica_preparing; DROP FUNCTION replica_prepare()')
  }
})

test("a read's code that puts a schema of its own ahead of pg_catalog cannot answer the replica's check in Postgres's place (it would take the replica from everyone)", async () => {
  const forged = (types: string) => `CREATE FUNCTION replica_forge.concat_ws(${types}) RETURNS text LANGUAGE sql AS $$ SELECT '0/0 f 0' $$`
  await admin.query(`CREATE SCHEMA replica_forge; GRANT USAGE ON SCHEMA replica_forge TO PUBLIC;
    ${['text, text, boolean, numeric', 'text, text, boolean, integer', 'text, text, boolean, double precision'].map(forged).join(';')};
    CREATE FUNCTION replica_forge_path() RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN PERFORM set_config('search_path', 'replica_forge, pg_catalog', false); RETURN pg_is_in_recovery(); END $$;
    CREATE VIEW replica_forging AS SELECT replica_forge_path() AS on_standby`)
  await standby.caughtUp()
  try {
    const p = await proxyWith({}, { pool: { mode: 'transaction', size: 1 } })
    const [c, d] = [new Client(clientConfig(p)), new Client(clientConfig(p))]
    await Promise.all([c.connect(), d.connect()])
    assert.deepEqual((await c.query('SELECT on_standby FROM replica_forging')).rows, [{ on_standby: true }])
    assert.equal((await c.query("SELECT pg_is_in_recovery() AS standby, current_setting('search_path') AS sp")).rows[0].sp, 'replica_forge, pg_catalog', "c's next read: its own backend, its search_path as its code left it")
    assert.equal(await where(c), 'replica', 'the check on that backend still says the replica serves')
    assert.equal(await where(d), 'replica', 'and for everyone else')
    assert.equal(await metric(p, 'replica_fallbacks_total', 'reason="promoted"'), 0)
    await Promise.all([c.end(), d.end()])
  } finally {
    await admin.query('DROP VIEW replica_forging; DROP FUNCTION replica_forge_path(); DROP SCHEMA replica_forge CASCADE')
  }
})

test('read your writes: a read right after a write waits for the lagging replica (or, past --replica-wait, goes to the primary); never an older answer', async () => {
  const waits = await proxyWith({ waitMs: 3000 })
  const hurries = await proxyWith({ waitMs: 50 })
  await standby.delay(400)
  try {
    for (const [p, expected] of [[waits, 'replica'], [hurries, 'primary']] as const) {
      const c = new Client(clientConfig(p))
      await c.connect()
      try {
        const tag = `ryw ${expected} ${Date.now()}`
        await c.query('INSERT INTO notes (body) VALUES ($1)', [tag])
        const r = await c.query('SELECT count(*)::int AS n, pg_is_in_recovery() AS standby FROM notes WHERE body = $1', [tag])
        assert.deepEqual(r.rows[0], { n: 1, standby: expected === 'replica' })
      } finally {
        await c.end()
      }
    }
    assert.equal(await metric(waits, 'replica_wait_seconds_count'), 1)
    assert.ok((await metric(waits, 'replica_wait_seconds_sum')) >= 0.3, 'it waited for the apply delay')
    assert.equal(await metric(hurries, 'replica_fallbacks_total', 'reason="position"'), 1)
  } finally {
    await standby.delay(0)
    await standby.caughtUp()
  }
})

test('read your writes whatever the client cuts: writes and reads in random WebSocket messages (Flush then Sync, Sync alone, pipelined groups, an error mid-pipeline, an implicit transaction a Query ends, explicit blocks); no read is stale', async () => {
  // (A standby idle a while, then behind a write, measures its lag from its last replay: past any small --replica-max-lag.)
  const p = await proxyWith({ waitMs: 10_000, maxLagMs: 600_000 })
  const protocols = await offeredLogin(async (extra) => ((c) => c.connect().then(() => c))(new Client(clientConfig(p, extra))))
  const seed = Number(process.env.EDGEPG_CUTS_SEED ?? Date.now() % 100_000)
  const r = prng(seed)
  const ext = (text: string, values: string[] = []) => [serialize.parse({ text }), serialize.bind({ values }), serialize.execute({})]
  const insert = (tag: string) => ext('INSERT INTO notes (body) VALUES ($1)', [tag])
  const sync = serialize.sync()
  const q = (text: string) => serialize.query(text)
  /**
   * Each write: its messages in the WebSocket messages a client sends one after another without waiting (a null: wait
   * for what was sent to be answered), how many ReadyForQuery end it, and the errors Postgres answers (none of the proxy's).
   */
  const shapes: Array<(tag: string) => { parts: Array<Buffer[] | null>; readies: number; errors?: string[] }> = [
    (tag) => ({ parts: [[...insert(tag), sync]], readies: 1 }),
    (tag) => ({ parts: [[...insert(tag), serialize.flush()], null, [sync]], readies: 1 }), // (pg-cursor's Flush, then Sync)
    (tag) => ({ parts: [insert(tag), [sync]], readies: 1 }), // (Sync alone, at once)
    (tag) => ({ parts: [[q(`INSERT INTO notes (body) VALUES ('${tag}')`)]], readies: 1 }),
    (tag) => ({ parts: [insert(tag), [q('SELECT 1')]], readies: 1 }), // (the implicit transaction a Query commits)
    (tag) => ({ parts: [[...insert(tag), sync, ...ext('SELECT 1'), sync]], readies: 2 }),
    (tag) => ({ parts: [[...insert(tag), sync], [...ext('SELECT 1/0'), sync]], readies: 2, errors: ['22012'] }), // (an error in a later group)
    // (Nothing of the proxy's runs inside the block: SET TRANSACTION must come before any query.)
    (tag) => ({ parts: [[q('BEGIN')], null, [q('SET TRANSACTION ISOLATION LEVEL REPEATABLE READ')], insert(tag), [sync], null, [q('COMMIT')]], readies: 4 }),
    (tag) => ({ parts: [[...ext('BEGIN'), ...insert(tag), ...ext('COMMIT'), sync]], readies: 1 }),
  ]
  /** `msgs` as one byte string cut at up to two random places: the WebSocket messages that carry it. */
  const cut = (msgs: Buffer[]) => {
    const bytes = Buffer.concat(msgs)
    const at = [r.int(bytes.length), r.int(bytes.length)].filter((n) => n > 0 && r.chance(0.5)).sort((a, b) => a - b)
    return [0, ...at].map((from, i, all) => bytes.subarray(from, all[i + 1] ?? bytes.length)).filter((b) => b.length)
  }
  await standby.delay(300)
  const s = await RawSession.open(p.port, protocols)
  const onReplica: boolean[] = []
  try {
    for (let round = 0; round < 24; round++) {
      const shape = round < shapes.length ? round : r.int(shapes.length)
      const tag = `cuts ${seed} ${round}`
      const { parts, readies } = shapes[shape](tag)
      const answers = []
      for (const [i, part] of parts.entries()) {
        if (part) for (const piece of cut(part)) s.send(piece)
        // (A wait for what was sent: behind a Flush, its answers so far; else its ReadyForQuery.)
        else if (parts[i - 1]!.at(-1)![0] === 0x48) await new Promise((resolve) => setTimeout(resolve, 50))
        else answers.push(await s.readies(1))
      }
      answers.push(await s.readies(readies - answers.length))
      const errors = answers.flat().filter((m) => m.type === 'E').map((m) => errorCode(m.body))
      assert.deepEqual(errors, shapes[shape](tag).errors ?? [], `seed ${seed}, round ${round}, shape ${shape}: what Postgres answered the write`)
      // (Cut less often: a read cut before its Sync is no autocommit read, and runs on the primary.)
      const read = [...ext("SELECT count(*)::int || ' ' || pg_is_in_recovery() FROM notes WHERE body = $1", [tag]), sync]
      for (const piece of r.chance(0.7) ? [Buffer.concat(read)] : cut(read)) s.send(piece)
      const row = (await s.readies(1)).find((m) => m.type === 'D')!.body
      const [n, standby] = row.toString('utf8', 6, 6 + row.readInt32BE(2)).split(' ')
      assert.equal(n, '1', `seed ${seed} (EDGEPG_CUTS_SEED), round ${round}, shape ${shape}: the read saw its session's write (on the ${standby === 'true' ? 'replica' : 'primary'})`)
      onReplica.push(standby === 'true')
    }
  } finally {
    await s.end()
    await standby.delay(0)
    await standby.caughtUp()
  }
  assert.ok(onReplica.filter(Boolean).length >= 8, `reads ran on the replica (${onReplica.filter(Boolean).length} of ${onReplica.length}), so the test tried it`)
})

test('a read waiting for the replica to replay its write holds no backend there and asks again with backoff: on one backend per key, another session reads there meanwhile (WebSocket and /sql)', async () => {
  const p = await proxyWith({ waitMs: 5000 }, { pool: { mode: 'transaction', size: 1 } })
  // (The other session speaks raw protocol: an edgepg Client would send the write's position, known process-wide, and wait too.)
  const fresh = await RawSession.open(p.port, await offeredLogin(async (extra) => ((c) => c.connect().then(() => c))(new Client(clientConfig(p, extra)))))
  const whereFresh = async () => ((await fresh.run(serialize.query('SELECT pg_is_in_recovery()'))).first === 't' ? 'replica' : 'primary')
  assert.equal(await whereFresh(), 'replica') // (the key's one backend on the replica is logged in)
  await standby.delay(1500)
  try {
    for (const over of ['ws', 'sql'] as const) {
      const writer = new Client(clientConfig(p))
      await writer.connect()
      try {
        const tag = `waits ${over} ${Date.now()}`
        await writer.query('INSERT INTO notes (body) VALUES ($1)', [tag])
        const checks = await metric(p, 'replica_checks_total')
        const order: string[] = []
        const read = 'SELECT count(*)::int AS n, pg_is_in_recovery() AS standby FROM notes WHERE body = $1'
        const waiting = (over === 'ws'
          ? writer.query(read, [tag]).then((r) => r.rows[0])
          : httpSql(`postgresql://scram_user:${PASSWORD}@127.0.0.1:${primary.port}/postgres`, { fetchEndpoint: `http://127.0.0.1:${p.port}/sql` }).query(read, [tag]).then((rows: any[]) => rows[0])
        ).then((row) => (order.push('waiting'), row))
        await new Promise((r) => setTimeout(r, 200))
        assert.equal(await whereFresh(), 'replica', `${over}: the other session reads on the replica`)
        order.push('other')
        assert.deepEqual(await waiting, { n: 1, standby: true }, `${over}: the waiting read saw its write, on the replica`)
        assert.deepEqual(order, ['other', 'waiting'], `${over}: the other read ran while the first waited`)
        const asked = (await metric(p, 'replica_checks_total')) - checks
        // (Every 5 ms as before, it would ask some 300 times in 1.5 s; with backoff about 13.)
        assert.ok(asked >= 3 && asked <= 24, `${over}: the waiting read asked again with backoff over ~1.5 s: ${asked} checks`)
      } finally {
        await writer.end()
      }
    }
  } finally {
    await fresh.end()
    await standby.delay(0)
    await standby.caughtUp()
  }
})

test('COPY FROM STDIN on the primary: nothing of the proxy\'s rides behind it (Postgres would take it for data), and its position is told once it is done', async () => {
  await admin.query('CREATE TABLE copied (n int, tag text)')
  await standby.caughtUp()
  const p = await proxyWith({ waitMs: 5000 })
  await standby.delay(400)
  const [writer, reader] = [new Client(clientConfig(p)), new Client(clientConfig(p))]
  await Promise.all([writer.connect(), reader.connect()])
  try {
    const count = 'SELECT count(*)::int AS n, pg_is_in_recovery() AS standby FROM copied WHERE tag = $1'
    // Autocommit, and inside a transaction (where the COMMIT ends it).
    for (const tag of ['autocommit', 'in a transaction']) {
      const before = lsn(config.lastWrite!.split(':')[1] ?? '') ?? 0n
      if (tag !== 'autocommit') await writer.query('BEGIN')
      await pipeline(Readable.from([`1\t${tag}\n2\t${tag}\n`]), writer.query(copyFrom('COPY copied FROM STDIN')))
      if (tag !== 'autocommit') await writer.query('COMMIT')
      assert.ok((lsn(config.lastWrite!.split(':')[1]) ?? 0n) > before, `${tag}: the COPY's position was told (config.lastWrite ${config.lastWrite})`)
      assert.deepEqual((await reader.query(count, [tag])).rows[0], { n: 2, standby: true }, `${tag}: another Client reads the copied rows on the replica`)
      assert.deepEqual((await writer.query(count, [tag])).rows[0], { n: 2, standby: true }, `${tag}: and so does the writer`)
    }
  } finally {
    await Promise.all([writer.end(), reader.end()])
    await standby.delay(0)
    await standby.caughtUp()
  }
})

test('a read running on the replica is cancelled there (an AbortSignal), and the session goes on', async () => {
  const p = await proxyWith()
  const c = new Client(clientConfig(p))
  await c.connect()
  const onStandby = standby.admin()
  await onStandby.connect()
  try {
    const controller = new AbortController()
    const sleeping = c.query({ text: 'SELECT pg_sleep(30), pg_is_in_recovery()', signal: controller.signal } as any)
    const running = async () => (await onStandby.query("SELECT count(*)::int AS n FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(30)%' AND state = 'active'")).rows[0].n
    const deadline = Date.now() + 5000
    while ((await running()) === 0) {
      assert.ok(Date.now() < deadline, 'the read runs on the standby')
      await new Promise((r) => setTimeout(r, 20))
    }
    controller.abort()
    assert.equal(await sleeping.then(() => 'ran to the end', (err: Error) => err === controller.signal.reason && err.name), 'AbortError')
    const gone = Date.now() + 5000
    while ((await running()) > 0) {
      assert.ok(Date.now() < gone, 'Postgres cancelled it on the standby')
      await new Promise((r) => setTimeout(r, 20))
    }
    assert.equal(await where(c), 'replica', 'the session goes on')
  } finally {
    await onStandby.end()
    await c.end()
  }
})

test('across Clients, Pools and httpSql in one process: config.lastWrite carries the position, so no read goes back in time', async () => {
  const p = await proxyWith({ waitMs: 3000 })
  await standby.delay(300)
  const pool = new Pool(clientConfig(p, { max: 2 }))
  const sql = sqlVia(p)
  try {
    // A Pool's connection made before the write, in another session than the write's.
    const idle = await pool.connect()
    const writer = new Client(clientConfig(p))
    await writer.connect()
    const tag = `across ${Date.now()}`
    await writer.query('INSERT INTO notes (body) VALUES ($1)', [tag])
    await writer.end()
    const [, told] = config.lastWrite!.split(':')
    assert.match(config.lastWrite!, /^\d+:[0-9A-F]+\/[0-9A-F]+$/)
    assert.ok(lsn(told)! <= lsn(await primaryLsn())!, `${told} is the primary's`)
    const count = 'SELECT count(*)::int AS n FROM notes WHERE body = $1'
    assert.equal((await idle.query(count, [tag])).rows[0].n, 1, 'a Pool connection opened before the write')
    idle.release()
    assert.equal((await pool.query(count, [tag])).rows[0].n, 1)
    assert.equal((await sql.query(count, [tag])).rows[0].n, 1, 'httpSql')
    // And the other way: a write over HTTP, read over a WebSocket.
    const tag2 = `${tag} http`
    await sql.query('INSERT INTO notes (body) VALUES ($1)', [tag2])
    assert.equal((await pool.query(count, [tag2])).rows[0].n, 1)
    const [, b] = await sql.transaction([sql`INSERT INTO notes (body) VALUES (${tag2})`, sql`SELECT count(*)::int AS n FROM notes WHERE body = ${tag2}`])
    assert.equal((b as any).rows[0].n, 2)
    assert.equal(((await sql.query(count, [tag2])) as any).rows[0].n, 2)
  } finally {
    await pool.end()
    await standby.delay(0)
    await standby.caughtUp()
  }
})

test('a Client tells its positions in the WebSocket message of the query they go ahead of (a second message right behind one waits ~40 ms where Nagle is on, as in Deno); a driver of edgepg.v4 in a text frame; both read what was written', async () => {
  const p = await proxyWith({ waitMs: 3000 })
  await standby.delay(300)
  /** A WebSocket that records what it sends; `frameOnly`: offering edgepg.v4 but not edgepg.v5, as drivers before it. */
  const recording = (sent: string[], frameOnly = false) =>
    class extends WebSocket {
      constructor(url: string, protocols?: string[]) {
        super(url, frameOnly ? protocols?.filter((p) => p !== SUBPROTOCOL_POSITIONS) : protocols)
      }
      send(data: any, ...rest: any[]) {
        sent.push(typeof data === 'string' ? data.split(' ')[0] : `binary ${String.fromCharCode(data[0])}`)
        return (super.send as any)(data, ...rest)
      }
    }
  try {
    for (const frameOnly of [false, true]) {
      const writer = new Client(clientConfig(p))
      await writer.connect()
      const tag = `told ${frameOnly} ${Date.now()}`
      await writer.query('INSERT INTO notes (body) VALUES ($1)', [tag])
      await writer.end()
      const sent: string[] = []
      const reader = new Client(clientConfig(p, { webSocketConstructor: recording(sent, frameOnly) }))
      await reader.connect()
      try {
        const r = await reader.query({ text: 'SELECT count(*)::int AS n FROM notes WHERE body = $1', values: [tag], queryMode: 'extended' } as any)
        assert.equal(r.rows[0].n, 1, 'the read waited for the position told')
        assert.equal((reader as any).connection.stream.ws.protocol, frameOnly ? 'edgepg.v4' : SUBPROTOCOL_POSITIONS)
        assert.deepEqual(sent, frameOnly ? ['after', 'binary P'] : ['binary @'], 'what the query was sent as')
      } finally {
        await reader.end()
      }
    }
    assert.equal(await metric(p, 'replica_fallbacks_total', 'reason="position"'), 0)
  } finally {
    await standby.delay(0)
    await standby.caughtUp()
  }
})

test('a position message over 1024 bytes closes the session, as an over-long `after` frame does: the proxy keeps no more of a client\'s positions than that', async () => {
  const p = await proxyWith()
  const c = new Client(clientConfig(p))
  await c.connect()
  try {
    const ws = (c as any).connection.stream.ws
    ws.send(positionMessage('1:0/0,'.repeat(160))) // 960 bytes: taken
    assert.equal(await where(c), 'replica')
    const closed = new Promise<Error>((resolve) => (c.on('error', resolve), setTimeout(() => resolve(new Error('still open after 5 s')), 5000).unref()))
    ws.send(positionMessage('1:0/0,'.repeat(200))) // 1,200 bytes
    assert.match((await closed).message, /code 1002: edgepg-proxy: position message too long/)
  } finally {
    await c.end().catch(() => {})
  }
})

test('/sql: readOnly batches and reads on the replica, and the position in the Edgepg-Last-Write header both ways', async () => {
  const p = await proxyWith()
  const post = (body: object, headers: Record<string, string> = {}) =>
    fetch(`http://127.0.0.1:${p.port}/sql`, {
      method: 'POST',
      headers: { 'Neon-Connection-String': `postgresql://scram_user:${PASSWORD}@127.0.0.1:${primary.port}/postgres`, ...headers },
      body: JSON.stringify(body),
    })
  const read = await post({ query: 'SELECT pg_is_in_recovery() AS standby', params: [] })
  assert.equal((await read.json()).rows[0].standby, true)
  const readAt = read.headers.get('edgepg-last-write')
  assert.match(readAt ?? '', /^\d+:[0-9A-F]+\/[0-9A-F]+$/, 'a read tells where it read')
  const batch = await post({ queries: [{ query: 'SELECT pg_is_in_recovery() AS standby', params: [] }] }, { 'Neon-Batch-Read-Only': 'true' })
  assert.equal((await batch.json()).results[0].rows[0].standby, true)
  const write = await post({ query: 'INSERT INTO notes (body) VALUES ($1)', params: ['over http'] })
  assert.equal(write.status, 200)
  const written = write.headers.get('edgepg-last-write')!
  const [id] = written.split(':')
  assert.ok(lsn(written.split(':')[1])! > lsn(readAt!.split(':')[1])!, 'the write is further on than the read before it')
  // A position no replica has reached (far ahead): the read waits --replica-wait, then the primary serves.
  const quick = await proxyWith({ waitMs: 50 })
  const ahead = `${id}:FFFF/0`
  const r = await fetch(`http://127.0.0.1:${quick.port}/sql`, {
    method: 'POST',
    headers: { 'Neon-Connection-String': `postgresql://scram_user:${PASSWORD}@127.0.0.1:${primary.port}/postgres`, 'Edgepg-Last-Write': ahead },
    body: JSON.stringify({ query: 'SELECT pg_is_in_recovery() AS standby', params: [] }),
  })
  assert.equal((await r.json()).rows[0].standby, false)
  assert.equal(await metric(quick, 'replica_fallbacks_total', 'reason="position"'), 1)
  // A position of another database is not waited on.
  const other = await fetch(`http://127.0.0.1:${quick.port}/sql`, {
    method: 'POST',
    headers: { 'Neon-Connection-String': `postgresql://scram_user:${PASSWORD}@127.0.0.1:${primary.port}/postgres`, 'Edgepg-Last-Write': '12345:FFFF/0' },
    body: JSON.stringify({ query: 'SELECT pg_is_in_recovery() AS standby', params: [] }),
  })
  assert.equal((await other.json()).rows[0].standby, true)
})

test('across processes: config.lastWrite read in one and set in another keeps the second from reading behind the first', async () => {
  const p = await proxyWith({ waitMs: 3000 })
  await standby.delay(400)
  try {
    const tag = `process ${Date.now()}`
    const { webSocketConstructor, wsProxy, ...plain } = clientConfig(p)
    const script = `
      import { WebSocket } from 'ws'
      import { Client, config } from './src/index.ts'
      const c = new Client({ ...${JSON.stringify(plain)}, webSocketConstructor: WebSocket, wsProxy: () => 'ws://127.0.0.1:${p.port}/v2' })
      await c.connect()
      await c.query('INSERT INTO notes (body) VALUES ($1)', [${JSON.stringify(tag)}])
      await c.end()
      console.log(config.lastWrite)`
    const { stdout } = await promisify(execFile)(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', script], { cwd: process.cwd() })
    const carried = stdout.trim()
    assert.match(carried, /^\d+:[0-9A-F]+\/[0-9A-F]+$/)
    config.lastWrite = carried
    const c = new Client(clientConfig(p))
    await c.connect()
    try {
      const r = await c.query('SELECT count(*)::int AS n, pg_is_in_recovery() AS standby FROM notes WHERE body = $1', [tag])
      assert.deepEqual(r.rows[0], { n: 1, standby: true })
    } finally {
      await c.end()
    }
  } finally {
    await standby.delay(0)
    await standby.caughtUp()
  }
})

test('a standby restarted behind under writes, that has replayed no transaction since (no replay time to measure its lag by), counts as behind: a fresh reader reads on the primary', async () => {
  const p = await proxyWith({ maxLagMs: 300 })
  const onStandby = async () => {
    const c = standby.admin()
    await c.connect()
    try {
      const { unmeasured, replayed } = (await c.query('SELECT pg_last_xact_replay_timestamp() IS NULL AS unmeasured, pg_last_wal_replay_lsn()::text AS replayed')).rows[0]
      return { unmeasured, behind: lsn(replayed)! < lsn(await primaryLsn())! }
    } finally {
      await c.end()
    }
  }
  // (Its restart replays from a restart point with no transaction after it: a checkpoint it has replayed.)
  await admin.query('CHECKPOINT')
  await standby.caughtUp()
  await ((c) => c.connect().then(() => c.query('CHECKPOINT')).finally(() => c.end()))(standby.admin())
  await standby.delay(10_000) // (no transaction replays while the test looks, however loaded the machine)
  let writing = true
  const writes = (async () => {
    while (writing) await admin.query('INSERT INTO notes (body) VALUES ($1)', ['steady']), await new Promise((r) => setTimeout(r, 20))
  })()
  const c = new Client(clientConfig(p))
  try {
    await standby.shutdown()
    await new Promise((r) => setTimeout(r, 300))
    await standby.start()
    assert.deepEqual(await onStandby(), { unmeasured: true, behind: true }, 'the standby is behind the primary, and has no replay time yet')
    await c.connect()
    for (let i = 0; i < 3; i++) assert.equal(await where(c), 'primary', `read ${i}`)
    assert.equal((await onStandby()).unmeasured, true, 'all the while')
    assert.ok((await metric(p, 'replica_fallbacks_total', 'reason="lag"')) >= 1, 'passed over for its lag')
  } finally {
    writing = false
    await writes
    await c.end()
    await standby.delay(0)
    await standby.caughtUp()
  }
})

test('a replica lagging past --replica-max-lag is passed over; one killed mid-run is too, with no error reaching a client; both come back', async () => {
  const p = await proxyWith({ maxLagMs: 200, waitMs: 3000 })
  const c = new Client(clientConfig(p))
  await c.connect()
  try {
    assert.equal(await where(c), 'replica')
    await standby.delay(1500)
    // Writes the client does not see (over TCP): the replica lags behind them.
    for (let i = 0; i < 5; i++) await admin.query('INSERT INTO notes (body) VALUES ($1)', ['lag']), await new Promise((r) => setTimeout(r, 100))
    await where(c) // its check finds the lag
    assert.ok((await metric(p, 'replica_lag_seconds', `replica="127.0.0.1:${standby.port}"`)) > 0.2)
    assert.equal(await where(c), 'primary')
    assert.ok((await metric(p, 'replica_fallbacks_total', 'reason="lag"')) >= 1)
    await standby.delay(0)
    await standby.caughtUp()
    await new Promise((r) => setTimeout(r, 2100)) // (passed over for 2 s, then tried again)
    let back = false
    for (let i = 0; i < 20 && !back; i++) back = (await where(c)) === 'replica'
    assert.ok(back, 'back on the replica once it caught up')

    await standby.shutdown()
    for (let i = 0; i < 10; i++) assert.equal(await where(c), 'primary')
    assert.ok((await metric(p, 'replica_fallbacks_total', 'reason="down"')) >= 1)
    assert.equal(await metric(p, 'replica_up', `replica="127.0.0.1:${standby.port}"`), 0)
    await standby.start()
    await standby.caughtUp()
    await new Promise((r) => setTimeout(r, 2100))
    back = false
    for (let i = 0; i < 20 && !back; i++) back = (await where(c)) === 'replica'
    assert.ok(back, 'back on the replica once it is up again')
  } finally {
    await c.end()
    await standby.delay(0).catch(() => {}) // (down, if an assertion failed: that is the error to see)
  }
})

test('a login serializable by default (a standby cannot run it) reads from the primary; the replica goes on serving the others', async () => {
  await admin.query(`CREATE ROLE serial_user LOGIN PASSWORD '${PASSWORD}'`)
  await admin.query("ALTER ROLE serial_user SET default_transaction_isolation = 'serializable'")
  await standby.caughtUp()
  const p = await proxyWith()
  const other = new Client(clientConfig(p))
  await other.connect()
  try {
    assert.equal(await where(other), 'replica')
    // By its StartupMessage (no replica tried), and by its role's setting (the replica's check fails for it alone).
    for (const extra of [{ options: '-c default_transaction_isolation=serializable' }, { user: 'serial_user' }]) {
      const c = new Client(clientConfig(p, extra))
      await c.connect()
      try {
        for (let i = 0; i < 3; i++) assert.equal(await where(c), 'primary', `${JSON.stringify(extra)}: read ${i}`)
        assert.equal((await c.query('SHOW transaction_isolation')).rows[0].transaction_isolation, 'serializable')
        assert.equal(await where(other), 'replica', 'the replica still serves the other session')
      } finally {
        await c.end()
      }
    }
    const serial = httpSql(`postgresql://serial_user:${PASSWORD}@127.0.0.1:${primary.port}/postgres`, { fetchEndpoint: `http://127.0.0.1:${p.port}/sql` })
    assert.deepEqual(await serial`SELECT pg_is_in_recovery() AS standby`, [{ standby: false }])
    assert.equal(await where(other), 'replica')
    // The role's session tried the replica once, /sql once; nothing counted the replica down.
    assert.equal(await metric(p, 'replica_fallbacks_total', 'reason="check_failed"'), 2)
    for (const reason of ['promoted', 'down']) assert.equal(await metric(p, 'replica_fallbacks_total', `reason="${reason}"`), 0, reason)
  } finally {
    await other.end()
    await admin.query('DROP ROLE serial_user')
  }
})

test('a login the standby refuses for what it asks (transaction_read_only=off, transaction_isolation=serializable in its options) reads on the primary; the replica stays up for everyone else', async () => {
  const p = await proxyWith()
  const other = new Client(clientConfig(p))
  await other.connect()
  try {
    assert.equal(await where(other), 'replica')
    for (const options of ['-c transaction_read_only=off', '-c transaction_isolation=serializable']) {
      for (let round = 0; round < 2; round++) {
        const c = new Client(clientConfig(p, { options }))
        await c.connect()
        try {
          for (let i = 0; i < 2; i++) assert.equal(await where(c), 'primary', `${options}: read ${i}`)
        } finally {
          await c.end()
        }
        assert.equal(await where(other), 'replica', 'the replica still serves the other session')
      }
    }
    assert.ok((await metric(p, 'replica_fallbacks_total', 'reason="refused"')) >= 4, 'each was refused there')
    assert.equal(await metric(p, 'replica_fallbacks_total', 'reason="down"'), 0, 'nothing counted the replica down')
    assert.equal(await metric(p, 'replica_up', `replica="127.0.0.1:${standby.port}"`), 1)
  } finally {
    await other.end()
  }
})

test("what the proxy reads of a login's options is what Postgres makes of them", async () => {
  const forms = ['-c default_transaction_isolation=serializable', '--default-transaction-isolation=SERIALIZABLE', '-cdefault_transaction_isolation=serializable -c default_transaction_isolation=read\\ committed',
    '-c default_transaction_isolation=repeatable\\ read -c default_transaction_read_only=on', '--default_transaction_read_only=yes', '-c default_transaction_read_only=off', '']
  for (const options of forms) {
    const c = new pg.Client({ host: '127.0.0.1', port: primary.port, user: 'scram_user', password: PASSWORD, database: 'postgres', options })
    await c.connect()
    const [{ iso, ro }] = (await c.query(`SELECT current_setting('default_transaction_isolation') AS iso, current_setting('default_transaction_read_only') AS ro`)).rows
    await c.end()
    const packet = serialize.startup({ user: 'scram_user', database: 'postgres', options })
    assert.deepEqual([serializableLogin(packet), readOnlyLogin(packet)], [iso === 'serializable', ro === 'on'], options)
  }
})

test("sessions by token read on the replica (WebSocket and /sql), with claims no session can forge there: the tokens suite's attacks, and the replica's own, on a standby backend; RLS gives the rows the primary gives", async () => {
  const table = `replica_rls_${process.pid}`
  const fx = await tokenFixture(table, primary)
  try {
    await standby.caughtUp()
    // (A standby idle a while, then behind a write, measures its lag from its last replay: past any small --replica-max-lag.)
    const p = await proxyWith({ maxLagMs: 600_000 }, { tokens: fx.options, pool: { mode: 'transaction', size: 2 } })
    const as = async (sub: string) => {
      const c = new Client({ host: '127.0.0.1', port: primary.port, database: 'postgres', authToken: await token(sub), webSocketConstructor: WebSocket as any, wsProxy: () => p.url })
      c.on('error', () => {})
      await c.connect()
      return c
    }
    const alice = await as('alice')
    const bob = await as('bob')
    const look = `SELECT edgepg.claims() ->> 'sub' AS sub, pg_is_in_recovery() AS standby, (SELECT array_agg(DISTINCT owner ORDER BY owner) FROM ${table}) AS owners`
    const sees = (c: Client) => c.query(look).then((r) => r.rows[0], (err) => ({ code: err.code }))
    // (A statement that calls functions the reader does not know goes to the primary, unless in a transaction begun read-only.)
    const readOnly = async <T>(c: Client, run: () => Promise<T>): Promise<T> => {
      await c.query('BEGIN READ ONLY')
      try {
        return await run()
      } finally {
        await c.query('ROLLBACK').catch(() => {})
      }
    }
    const seesThere = (c: Client) => readOnly(c, () => sees(c))
    try {
      assert.deepEqual(await sees(alice), { sub: 'alice', standby: false, owners: ['alice'] }, 'the first lend, on the primary, learns the replica key')
      // (A transaction that called code is asked about on its backend, which the session's next statement may ride meanwhile.)
      const there = async (c: Client) => {
        let seen = await seesThere(c)
        for (let i = 0; i < 20 && !seen.standby; i++) await new Promise((r) => setTimeout(r, 20)), (seen = await seesThere(c))
        return seen
      }
      assert.deepEqual(await there(alice), { sub: 'alice', standby: true, owners: ['alice'] }, 'alice reads on the replica, as alice')
      assert.deepEqual(await there(bob), { sub: 'bob', standby: true, owners: ['bob'] })
      // Each attack on the standby, in a transaction begun read-only: nothing makes the session another's, or shows another's rows.
      const ownMac = `set_config('edgepg.claims_mac', current_setting('edgepg.claims_mac', true), false)`
      const attacks = [
        ...claimsAttacks(table),
        `SELECT edgepg.set_replica_claims('{"sub":"bob","exp":99999999999}', decode(repeat('00', 32), 'hex'))`,
        `SELECT edgepg.set_replica_claims('{"sub":"bob","exp":99999999999}', NULL)`,
        `SELECT edgepg.replica_key(1, decode(repeat('00', 32), 'hex'))`,
        `SELECT * FROM edgepg.replica_key`,
        `SELECT edgepg.replica_mac('{"sub":"bob"}')`,
        `SELECT set_config('edgepg.claims', '{"sub":"bob"}', false), ${ownMac}`,
        `SELECT set_config('edgepg.claims', current_setting('edgepg.claims') || ' ', false), ${ownMac}`,
      ]
      for (const attack of attacks) {
        const after = await readOnly(alice, async () => (await alice.query(attack).catch(() => {}), await sees(alice)))
        // (Refused, or alice's claims or none, and her rows or none: never bob's. An attack that ends the transaction leaves the read to the primary.)
        assert.ok(after.code === '42501' || after.code === '25P02' || ([null, 'alice'].includes(after.sub) && (after.owners ?? ['alice']).join() === 'alice'), `${attack}: ${JSON.stringify(after)}`)
        assert.deepEqual(await there(alice), { sub: 'alice', standby: true, owners: ['alice'] }, `after ${attack}`)
      }
      // Another backend's claims and MAC, replayed: they hold on the backend that made them only.
      await alice.query('BEGIN READ ONLY')
      const mine = (await alice.query(`SELECT current_setting('edgepg.claims') AS claims, current_setting('edgepg.claims_mac') AS mac, pg_backend_pid() AS pid, pg_is_in_recovery() AS standby`)).rows[0]
      await bob.query('BEGIN READ ONLY')
      assert.notEqual((await bob.query('SELECT pg_backend_pid() AS pid')).rows[0].pid, mine.pid, 'bob runs on the other standby backend')
      await bob.query(`SELECT set_config('edgepg.claims', $1, false), set_config('edgepg.claims_mac', $2, false)`, [mine.claims, mine.mac])
      assert.equal((await sees(bob)).code, '42501', "alice's claims and MAC on bob's backend: refused")
      await Promise.all([alice.query('ROLLBACK'), bob.query('ROLLBACK')])
      assert.equal(mine.standby, true)
      // A write (on the primary), then RLS on the replica once it has replayed it: the primary's rows.
      await alice.query(`INSERT INTO ${table} (body) VALUES ('from the edge')`)
      const onReplica = (await alice.query(`SELECT body, pg_is_in_recovery() AS standby FROM ${table} ORDER BY id`)).rows
      const onPrimary = (await fx.admin.query(`SELECT body FROM ${table} WHERE owner = 'alice' ORDER BY id`)).rows
      assert.deepEqual(onReplica.map((r) => r.body), onPrimary.map((r) => r.body))
      assert.ok(onReplica.every((r) => r.standby), 'read on the replica')
      // /sql by token, with the key the sessions learnt: a plain read, and a read-only batch an attack leads, on the replica.
      const overHttp = httpSql(`postgres://127.0.0.1:${primary.port}/postgres`, { fetchEndpoint: `http://127.0.0.1:${p.port}/sql`, authToken: () => token('alice') })
      const read = (await overHttp.query(`SELECT DISTINCT owner, pg_is_in_recovery() AS standby FROM ${table}`)) as any[]
      assert.deepEqual(read, [{ owner: 'alice', standby: true }], '/sql: her rows, on the replica')
      for (const attack of [`SELECT set_config('edgepg.claims', '{"sub":"bob"}', false)`, `SELECT edgepg.set_replica_claims('{"sub":"bob","exp":99999999999}', decode(repeat('00', 32), 'hex'))`]) {
        const batch = await overHttp.transaction((sql) => [sql.query(attack), sql.query(look)], { readOnly: true }).then((r: any[]) => r[1][0], (err) => ({ code: err.code }))
        assert.ok(batch.code === '42501' || (batch.standby && [null, 'alice'].includes(batch.sub) && (batch.owners ?? ['alice']).join() === 'alice'), `/sql ${attack}: ${JSON.stringify(batch)}`)
      }
      assert.equal(await metric(p, 'replica_fallbacks_total', 'reason="refused"'), 0)
    } finally {
      await Promise.all([alice.end(), bob.end()])
    }
  } finally {
    await fx.teardown()
  }
})

test('round trips far from the primary: with the replica next to the proxy, a fresh read costs two short round trips, a warm read or a read right after a write one, a write one short and one long', async () => {
  // The user 100 ms (RTT) from the proxy, the primary 300 ms beyond it, the replica next to the proxy.
  const SHORT = 100
  const wan = await startDelayRelay({ host: '127.0.0.1', port: primary.port }, 150)
  const p = await startProxy({ upstream: `127.0.0.1:${wan.port}`, replicas: { addresses: [`127.0.0.1:${standby.port}`], maxLagMs: 5000, waitMs: 3000, autocommit: true } })
  proxies.push(p)
  const near = await startDelayRelay({ host: '127.0.0.1', port: p.port }, SHORT / 2)
  const config = { ...clientConfig(p), port: wan.port, wsProxy: () => `ws://127.0.0.1:${near.port}/v2` }
  const trips = async (fn: () => Promise<unknown>) => {
    const t0 = performance.now()
    await fn()
    return Math.floor((performance.now() - t0) / SHORT)
  }
  const read = 'SELECT count(*)::int AS n, pg_is_in_recovery() AS standby FROM notes WHERE body = $1'
  try {
    for (let i = 0; i < 2; i++) {
      const warmUp = new Client(config) // (the key's first logins, on the primary and the replica)
      await warmUp.connect()
      await warmUp.query(read, ['warm-up'])
      await warmUp.end()
    }
    const c = new Client(config)
    const tag = `trips ${Date.now()}`
    assert.equal(await trips(async () => (await c.connect(), await c.query(read, [tag]))), 2, 'a fresh read: the login, then the query')
    assert.equal(await trips(() => c.query(read, [tag])), 1, 'a warm read')
    assert.equal(await trips(() => c.query('INSERT INTO notes (body) VALUES ($1)', [tag])), 4, 'a write: one short and one long')
    let after: any
    assert.equal(await trips(async () => (after = await c.query(read, [tag]))), 1, 'the read right after it')
    assert.deepEqual(after.rows[0], { n: 1, standby: true })
    await c.end()
  } finally {
    await near.close()
    await wan.close()
  }
})
