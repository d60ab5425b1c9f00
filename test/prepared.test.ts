/**
 * Named prepared statements that follow a session across backends (proxy/pool/prepared.ts), against
 * the real Postgres: a session's flights go to backend A or B through the relay, and what the client
 * sees must be what one connection answers to the same flights, error for error (42P05 for a name
 * parsed twice, 26000 for an unknown one), including what broke in PgBouncer: a pipelined
 * DEALLOCATE ALL, DISCARD ALL from the client, COPY between statements, eviction mid-pipeline.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import net from 'node:net'
import { serialize } from 'pg-protocol'
import { BackendStatements, StatementRelay, type SessionStatements } from '../proxy/pool/prepared'
import { Framer } from '../proxy/wire/bytes'
import { pgConfig } from './support/helpers'
import { startupMessage } from './support/protocol'

const { host, port, database } = pgConfig('trust_user') as Record<string, string>

/** A plain connection to Postgres, logged in: send bytes, read messages up to so many ReadyForQuery. */
async function connection() {
  const socket = net.connect({ host, port: Number(port) })
  const framer = new Framer()
  let pending: Buffer[] = []
  let wake = () => {}
  socket.on('data', (chunk) => {
    pending.push(chunk)
    wake()
  })
  socket.on('error', () => {})
  /** Messages (through `relay`) up to the one `last` picks, and any that came with it. */
  const readUntil = async (last: (msg: Buffer) => boolean, relay = (chunk: Buffer) => chunk): Promise<Buffer[]> => {
    const got: Buffer[] = []
    for (let done = false; !done; ) {
      if (!pending.length) await new Promise<void>((r) => (wake = r))
      const chunks = pending
      pending = []
      for (const msg of framer.push(relay(Buffer.concat(chunks)))) got.push(msg), (done ||= last(msg))
    }
    return got
  }
  const readUntilReady = async (readies: number, relay?: (chunk: Buffer) => Buffer) => (readies > 0 ? readUntil((m) => m[0] === 0x5a && --readies === 0, relay) : [])
  socket.write(startupMessage({ user: 'trust_user', database }))
  await readUntilReady(1)
  return { socket, readUntil, readUntilReady, end: () => socket.end(serialize.end()) }
}
type Connection = Awaited<ReturnType<typeof connection>>

let A: Connection, B: Connection
before(async () => ([A, B] = await Promise.all([connection(), connection()])))
after(() => (A.end(), B.end()))

/** One flight: client messages, the backend it goes to. */
type Flight = [Buffer[], 'A' | 'B']

/** Postgres's answers in brief: type, and an error's SQLSTATE, a tag, a row. */
function brief(msgs: Buffer[]): string[] {
  return msgs.map((m) => {
    const type = String.fromCharCode(m[0])
    if (type === 'E') return `E ${/C([0-9A-Z]{5})\0/.exec(m.toString('latin1', 5))?.[1]}`
    if (type === 'C') return `C ${m.toString('utf8', 5, m.length - 1)}`
    if (type === 'D') return `D ${m.toString('utf8', 11)}`
    if (type === 'Z') return `Z ${String.fromCharCode(m[5])}`
    return type
  }).filter((t) => t !== 'S' && t !== 'N') // (ParameterStatus, notices: not the point)
}

const readiesIn = (msgs: Buffer[]) => msgs.filter((m) => m[0] === 0x53 || m[0] === 0x51).length

interface Session {
  statements: SessionStatements
  backends: { A: BackendStatements; B: BackendStatements }
  /** The same session on one connection of its own: what the client must see. */
  alone: Connection
}
const sessions: Session[] = []
after(() => sessions.forEach((s) => s.alone.end()))
async function session(backends = { A: new BackendStatements(), B: new BackendStatements() }): Promise<Session> {
  const s = { statements: new Map(), backends, alone: await connection() }
  sessions.push(s)
  return s
}

/** The flights through the relay, moving between A and B, and alone: the same answers. */
async function compare(flights: Flight[], s?: Session) {
  s ??= await session()
  const relayed: string[] = []
  const expected: string[] = []
  for (const [msgs, on] of flights) {
    const conn = on === 'A' ? A : B
    const relay = new StatementRelay(s.statements, s.backends[on], (bytes) => conn.socket.write(bytes))
    relay.fromClient(Buffer.concat(msgs))
    relayed.push(...brief(await conn.readUntilReady(readiesIn(msgs), (c) => relay.fromBackend(c))))
    s.alone.socket.write(Buffer.concat(msgs))
    expected.push(...brief(await s.alone.readUntilReady(readiesIn(msgs))))
  }
  assert.deepEqual(relayed, expected)
  return relayed
}

const parse = (name: string, text: string) => serialize.parse({ name, text, types: [] })
const run = (statement: string, values: string[] = []) => [serialize.bind({ statement, values }), serialize.describe({ type: 'P' }), serialize.execute({}), serialize.sync()]
const query = (text: string) => serialize.query(text)
const sync = serialize.sync()

test('a statement prepared on one backend runs on another', async () => {
  const seen = await compare([
    [[parse('s1', "SELECT 'one' || $1::text"), sync], 'A'],
    [run('s1', ['!']), 'B'],
    [run('s1', ['?']), 'A'],
  ])
  assert.ok(seen.includes('D one!') && seen.includes('D one?'), seen.join(' | '))
})

test('a name parsed twice is 42P05, an unknown one 26000, a closed one 26000 again: where one connection says so', async () => {
  const seen = await compare([
    [[parse('s2', 'SELECT 2'), sync], 'A'],
    [[parse('s2', 'SELECT 22'), sync], 'B'],
    [run('nope'), 'B'],
    [[serialize.close({ type: 'S', name: 's2' }), sync], 'A'],
    [run('s2'), 'B'],
    [[parse('s2', 'SELECT 222'), sync], 'B'],
    [run('s2'), 'A'],
  ])
  assert.deepEqual(seen.filter((s) => s.startsWith('E')), ['E 42P05', 'E 26000', 'E 26000'])
  assert.ok(seen.includes('D 222'))
})

test("messages sent into a group Postgres is skipping after an error (pg-cursor's Close and Sync once a portal failed) are not awaited: what comes after goes to whom it answers", async () => {
  const s = await session()
  const relay = new StatementRelay(s.statements, s.backends.A, (bytes) => A.socket.write(bytes))
  const through = (c: Buffer) => relay.fromBackend(c)
  relay.fromClient(Buffer.concat([parse('', 'SELECT 1/0'), serialize.bind({ portal: 'p' }), serialize.describe({ type: 'P', name: 'p' }), serialize.execute({ portal: 'p', rows: 100 }), serialize.flush()]))
  assert.deepEqual(brief(await A.readUntil((m) => m[0] === 0x45, through)).at(-1), 'E 22012')
  // The error is in when the client closes the portal: Postgres skips the Close, and answers the Sync alone.
  relay.fromClient(Buffer.concat([serialize.close({ type: 'P', name: 'p' }), sync]))
  assert.deepEqual(brief(await A.readUntilReady(1, through)), ['Z I'])
  // A query of the proxy's own, then the client's: each gets its own answer.
  const rows: string[] = []
  relay.ownQuery({ query: query("SELECT 'own'"), onRow: (v) => rows.push(v) })
  relay.fromClient(query("SELECT 'mine'"))
  assert.deepEqual(brief(await A.readUntilReady(1, through)), ['T', 'D mine', 'C SELECT 1', 'Z I'])
  assert.deepEqual(rows, ['own'])
})

test('two sessions with the same name for different statements share a backend, each its own', async () => {
  const backends = { A: new BackendStatements(), B: new BackendStatements() }
  const [one, two] = [await session(backends), await session(backends)]
  await compare([[[parse('s', "SELECT 'first'"), sync], 'A']], one)
  await compare([[[parse('s', "SELECT 'second'"), sync], 'B']], two)
  assert.ok((await compare([[run('s'), 'B']], one)).includes('D first'))
  assert.ok((await compare([[run('s'), 'A']], two)).includes('D second'))
})

test('DEALLOCATE ALL pipelined, DISCARD ALL and DEALLOCATE from the client drop the protocol statements too', async () => {
  await compare([
    [[parse('d1', 'SELECT 1'), parse('d2', 'SELECT 2'), sync], 'A'],
    [[query('DEALLOCATE ALL'), ...run('d1')], 'B'],
    [[parse('d1', 'SELECT 11'), sync], 'B'],
    [run('d1'), 'A'],
    [[query('DISCARD ALL'), ...run('d1')], 'A'],
    [[parse('d3', 'SELECT 3'), parse('d4', 'SELECT 4'), sync], 'B'],
    [[query('DEALLOCATE d3'), ...run('d3'), ...run('d4')], 'A'],
  ])
})

test('COPY between statements', async () => {
  await compare([
    [[parse('c1', "SELECT 'after copy'"), sync], 'A'],
    [[query('COPY (SELECT 1) TO STDOUT'), ...run('c1')], 'B'],
  ])
})

test('eviction in the middle of a pipeline: a backend holds at most its limit, and every statement still runs', async () => {
  const s = await session({ A: new BackendStatements(2), B: new BackendStatements(2) })
  const seen = await compare(
    [
      [[parse('e1', 'SELECT 1'), parse('e2', 'SELECT 2'), parse('e3', 'SELECT 3'), sync], 'A'],
      [[...run('e1').slice(0, 3), ...run('e2').slice(0, 3), ...run('e3')], 'B'],
      [[...run('e3').slice(0, 3), ...run('e1')], 'A'],
    ],
    s
  )
  assert.deepEqual(seen.filter((t) => t.startsWith('D')), ['D 1', 'D 2', 'D 3', 'D 3', 'D 1'])
  assert.ok(s.backends.A.held.size <= 2 && s.backends.B.held.size <= 2, `held: ${[...s.backends.A.held.keys()]} / ${[...s.backends.B.held.keys()]}`)
})

test('a statement is not closed under an open portal: a named portal read in parts keeps working while others are prepared', async () => {
  const s = await session({ A: new BackendStatements(1), B: new BackendStatements(1) })
  const portal = (statement: string) => serialize.bind({ portal: 'p', statement })
  await compare(
    [
      [[parse('big', 'SELECT generate_series(1, 3)'), parse('other', 'SELECT 9'), sync], 'A'],
      [[query('BEGIN'), portal('big'), serialize.execute({ portal: 'p', rows: 1 }), sync], 'B'],
      [[...run('other'), serialize.execute({ portal: 'p', rows: 1 }), sync, query('COMMIT')], 'B'],
    ],
    s
  )
})

test('a statement whose table is gone fails on the new backend as on the old', async () => {
  const admin = await connection()
  admin.socket.write(query('CREATE TABLE IF NOT EXISTS prepared_gone (x int)'))
  await admin.readUntilReady(1)
  const s = await session()
  await compare([[[parse('g1', 'SELECT x FROM prepared_gone'), sync], 'A']], s)
  admin.socket.write(query('DROP TABLE prepared_gone'))
  await admin.readUntilReady(1)
  admin.end()
  const seen = await compare([[run('g1'), 'B'], [[parse('ok', 'SELECT 1'), ...run('ok')], 'B']], s)
  assert.equal(seen[0], 'E 42P01')
  // Through SQL's EXECUTE, Postgres words it differently on the new backend (the statement could not be made there).
  const s2 = await session()
  await compare([[[parse('g2', 'SELECT 1'), sync], 'A']], s2)
  const relay = new StatementRelay(s2.statements, new BackendStatements(), (bytes) => B.socket.write(bytes))
  s2.statements.set('g2', parse('g2', 'SELECT x FROM prepared_gone'))
  relay.fromClient(query('EXECUTE g2'))
  assert.deepEqual(brief(await B.readUntilReady(1, (c) => relay.fromBackend(c))), ['E 26000', 'Z I'], 'one error, and the session goes on')
})

test("DDL that changes a statement's result type: Postgres's 0A000 on every backend, as on one connection; a statement prepared after the DDL runs everywhere", async () => {
  const admin = await connection()
  admin.socket.write(query('DROP TABLE IF EXISTS prepared_shape; CREATE TABLE prepared_shape (x int); INSERT INTO prepared_shape VALUES (1)'))
  await admin.readUntilReady(1)
  const backends = { A: new BackendStatements(), B: new BackendStatements() }
  const before = await session(backends)
  const stale = await session(backends) // its copy on B is made before the DDL too
  await compare([[[parse('shape', 'SELECT * FROM prepared_shape'), sync], 'A']], before)
  await compare([[[parse('shape2', 'SELECT * FROM prepared_shape'), sync], 'A'], [run('shape2'), 'B']], stale)
  admin.socket.write(query('ALTER TABLE prepared_shape ADD COLUMN y int'))
  await admin.readUntilReady(1)
  // Prepared again on B with the new type, the session's statement still has the old one: 0A000 there too, each time.
  const seen = await compare([[run('shape'), 'B'], [run('shape'), 'A'], [run('shape'), 'B']], before)
  assert.deepEqual(seen.filter((m) => m.startsWith('E')), ['E 0A000', 'E 0A000', 'E 0A000'])
  // Prepared after the DDL, on a backend whose copy is older: prepared again there, and it runs.
  const after = await session(backends)
  const ran = await compare([[[parse('shape2', 'SELECT * FROM prepared_shape'), sync], 'A'], [run('shape2'), 'B']], after)
  assert.deepEqual(ran.filter((m) => m.startsWith('E')), [])
  admin.socket.write(query('DROP TABLE prepared_shape'))
  await admin.readUntilReady(1)
  admin.end()
})

test('SQL EXECUTE and DEALLOCATE of a statement the protocol prepared, on another backend', async () => {
  await compare([
    [[parse('x1', "SELECT 'x'"), sync], 'A'],
    [[query('EXECUTE x1')], 'B'],
    [[query('DEALLOCATE x1'), ...run('x1')], 'A'],
  ])
})
