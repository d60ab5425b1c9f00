/**
 * A pooled connection inside a transaction never serves another caller: the one place edgepg is
 * stricter than pg. On the package as Node imports it and on the bundle, through the real proxy;
 * what committed is checked over TCP, outside edgepg.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import pg from 'pg'
import { WebSocket } from 'ws'
import { startProxy, edgeConfig, eventually, scratchTable } from './support/helpers'

let proxy: Awaited<ReturnType<typeof startProxy>>
let scratch: Awaited<ReturnType<typeof scratchTable>>
let table: string

before(async () => {
  proxy = await startProxy()
  scratch = await scratchTable('pool_tx', 'tag text NOT NULL, name text NOT NULL')
  table = scratch.name
})
after(async () => {
  await scratch?.drop()
  await proxy?.close()
})

const committed = async (tag: string) => (await scratch.tcp.query(`SELECT name FROM ${table} WHERE tag = $1 ORDER BY name`, [tag])).rows.map((r) => r.name)

const builds = {
  package: async () => (await import('edgepg' as string)).Pool,
  bundle: async () => (await import('../dist/index.mjs' as string)).Pool,
}

for (const [build, load] of Object.entries(builds)) {
  const newPool = async () => {
    const Pool = await load()
    return new Pool({ ...edgeConfig(proxy.port), webSocketConstructor: WebSocket, max: 1 }) as pg.Pool
  }

  test(`${build}: pool.query('BEGIN') rejects, names the fix, and the connection goes back rolled back`, async () => {
    const pool = await newPool()
    try {
      for (const text of ['BEGIN', 'START TRANSACTION', `BEGIN; INSERT INTO ${table} VALUES ('${build}-begin', 'lost')`]) {
        await assert.rejects(pool.query(text), (err: Error) => /pool\.connect\(\)/.test(err.message) && /rolled back/.test(err.message), text)
      }
      // The callback form reports it too.
      const viaCallback = await new Promise<Error | undefined>((resolve) => pool.query('BEGIN', (err: Error | undefined) => resolve(err)))
      assert.match(String(viaCallback?.message), /left its connection in a transaction/)
      // The one connection (max 1) is out of the transaction: this insert commits by itself.
      await pool.query(`INSERT INTO ${table} VALUES ($1, 'kept')`, [`${build}-begin`])
      assert.deepEqual(await committed(`${build}-begin`), ['kept'], 'the later insert committed; the one inside the refused transaction did not')
      const client = await pool.connect()
      assert.equal(client.getTransactionStatus(), 'I')
      client.release()
    } finally {
      await pool.end()
    }
  })

  test(`${build}: an error from pool.query() carries its caller's frames in its stack (async stack trace), as pg's Pool's does`, async () => {
    const pool = await newPool()
    try {
      for (const text of ['SELECT test FROM no_such_table_at_all', 'BEGIN']) {
        async function queryingCaller() {
          await pool.query(text)
        }
        const err: Error = await (async function awaitingCaller() {
          await queryingCaller()
        })().then(() => assert.fail(`${text}: no error`), (e) => e)
        assert.ok(err.stack?.includes('queryingCaller') && err.stack.includes('awaitingCaller'), `${text}: ${err.stack}`)
      }
    } finally {
      await pool.end()
    }
  })

  test(`${build}: a client released inside a transaction is rolled back before the next caller gets it`, async () => {
    const pool = await newPool()
    const tag = `${build}-release`
    try {
      const a = await pool.connect()
      await a.query('BEGIN')
      await a.query(`INSERT INTO ${table} VALUES ($1, 'uncommitted')`, [tag])
      const pid = (await a.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
      a.release() // forgot COMMIT
      // Another request, meanwhile: on the same connection (max 1), outside any transaction.
      await pool.query(`INSERT INTO ${table} VALUES ($1, 'other request')`, [tag])
      const b = await pool.connect()
      assert.equal((await b.query('SELECT pg_backend_pid() AS pid')).rows[0].pid, pid, 'the same connection')
      assert.equal(b.getTransactionStatus(), 'I')
      await b.query('BEGIN')
      await b.query('SELECT 1/0').catch(() => {}) // failed transaction: status E
      // (pg calls back on the ErrorResponse, maybe before the ReadyForQuery that says 'E' is read.)
      await eventually(() => b.getTransactionStatus() === 'E', "ReadyForQuery with status 'E'")
      b.release()
      const c = await pool.connect()
      assert.equal(c.getTransactionStatus(), 'I', 'a failed transaction is rolled back too')
      c.release()
      assert.deepEqual(await committed(tag), ['other request'], "the other request's insert committed; the forgotten transaction's did not")
    } finally {
      await pool.end()
    }
  })
}

test("Drizzle's neon-serverless handed edgepg's Pool (not Neon's): its transaction fails loudly, and nothing else is lost", async () => {
  const { drizzle } = await import('drizzle-orm/neon-serverless')
  const { pgTable, text } = await import('drizzle-orm/pg-core')
  const items = pgTable(table, { tag: text('tag').notNull(), name: text('name').notNull() })
  const Pool = await builds.package()
  const pool = new Pool({ ...edgeConfig(proxy.port), webSocketConstructor: WebSocket, max: 2 })
  const tag = 'drizzle-neon-direct'
  try {
    // Drizzle takes a Pool that is not Neon's for one connection and sends BEGIN through pool.query.
    const db = drizzle({ client: pool as any })
    await assert.rejects(
      db.transaction(async (tx) => {
        await tx.insert(items).values({ tag, name: 'inside' })
      }),
      (err: Error) => /pool\.connect\(\)/.test(String((err.cause as Error)?.message)), // Drizzle's "Failed query: begin", caused by ours
    )
    await db.insert(items).values({ tag, name: 'other request' })
    assert.deepEqual(await committed(tag), ['other request'])
  } finally {
    await pool.end()
  }
})
