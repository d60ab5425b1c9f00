import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import pg from 'pg'
import { drizzle } from 'drizzle-orm/node-postgres'
import { pgTable, serial, text, integer } from 'drizzle-orm/pg-core'
import { and, eq, asc, sql } from 'drizzle-orm'
import { Kysely, PostgresDialect, type Generated } from 'kysely'
import { startProxy, edgePool, edgeConfig, pgConfig, same } from './support/helpers'

// The ORMs/query builders people put on top of pg, running over edgepg's Pool (through the proxy).
// A unique table per run; rolled-back rows are checked over plain TCP, outside edgepg.

const table = `eco_items_${process.pid}_${Date.now()}`
let proxy: Awaited<ReturnType<typeof startProxy>>
let tcp: pg.Client

before(async () => {
  proxy = await startProxy()
  tcp = new pg.Client(pgConfig('scram_user'))
  await tcp.connect()
  await tcp.query(`CREATE TABLE ${table} (id serial PRIMARY KEY, name text NOT NULL, qty integer NOT NULL, tag text NOT NULL)`)
})

after(async () => {
  try {
    await tcp?.query(`DROP TABLE IF EXISTS ${table}`)
  } finally {
    await tcp?.end()
    await proxy?.close()
  }
})

/** Rows with `tag`, as seen over TCP (not through edgepg). */
async function tcpRows(tag: string) {
  const { rows } = await tcp.query(`SELECT name, qty FROM ${table} WHERE tag = $1 ORDER BY id`, [tag])
  return rows
}

// The sources (as the other tests do), and the package as a Node app imports it (package.json
// "exports" → dist/node.mjs, on the installed pg): Drizzle runs a transaction on one pooled
// connection only for a Pool it recognises as pg's.
for (const from of ['src', 'package'] as const) test(`Drizzle (node-postgres dialect) over edgepg Pool (${from}): CRUD and a rolled-back transaction`, async () => {
  const items = pgTable(table, {
    id: serial('id').primaryKey(),
    name: text('name').notNull(),
    qty: integer('qty').notNull(),
    tag: text('tag').notNull(),
  })
  const { Pool } = from === 'src' ? { Pool: undefined } : await import('edgepg' as string)
  const pool: pg.Pool = Pool ? new Pool(edgeConfig(proxy.port, 'scram_user', { max: 3 } as object)) : edgePool(proxy.port, { max: 3 })
  try {
    const db = drizzle(pool)
    const tag = `drizzle-${from}`

    const inserted = await db.insert(items).values([{ name: 'apple', qty: 1, tag }, { name: 'pear', qty: 2, tag }]).returning()
    assert.equal(inserted.length, 2, 'insert … returning gives both rows')
    assert.ok(inserted.every((r) => Number.isInteger(r.id) && r.id > 0), 'returned rows carry serial ids')
    same(inserted.map(({ name, qty, tag }) => ({ name, qty, tag })), [{ name: 'apple', qty: 1, tag }, { name: 'pear', qty: 2, tag }], 'inserted rows')

    const pear = await db.select().from(items).where(and(eq(items.name, 'pear'), eq(items.tag, tag)))
    same(pear, [inserted[1]], 'select … where name = pear')

    const updated = await db.update(items).set({ qty: 20 }).where(eq(items.id, inserted[1].id)).returning({ qty: items.qty })
    same(updated, [{ qty: 20 }], 'update … returning')

    await db.delete(items).where(eq(items.id, inserted[0].id))
    const left = await db.select({ name: items.name, qty: items.qty }).from(items).where(eq(items.tag, tag)).orderBy(asc(items.id))
    same(left, [{ name: 'pear', qty: 20 }], 'rows after update and delete')

    // A committed transaction, then one that throws after writing: its rows must be gone.
    await db.transaction(async (tx) => {
      await tx.insert(items).values({ name: 'plum', qty: 3, tag })
    })
    await assert.rejects(
      db.transaction(async (tx) => {
        await tx.insert(items).values({ name: 'ghost', qty: 99, tag })
        await tx.update(items).set({ qty: 0 }).where(and(eq(items.name, 'pear'), eq(items.tag, tag)))
        const seen = await tx.select().from(items).where(eq(items.name, 'ghost'))
        assert.equal(seen.length, 1, 'the transaction sees its own insert')
        const [a, b] = await Promise.all([tx.execute(sql`SELECT pg_backend_pid() AS pid`), tx.execute(sql`SELECT pg_backend_pid() AS pid`)])
        assert.equal(a.rows[0].pid, b.rows[0].pid, 'statements at once in a transaction share its one connection')
        throw new Error('boom')
      }),
      /boom/,
      'db.transaction rethrows the error'
    )
    same(await tcpRows(tag), [{ name: 'pear', qty: 20 }, { name: 'plum', qty: 3 }], 'over TCP: committed rows present, rolled-back insert/update absent')
    assert.equal(pool.totalCount - pool.idleCount, 0, 'no pool client left checked out')
  } finally {
    await pool.end()
  }
})

interface Database {
  [key: string]: { id: Generated<number>; name: string; qty: number; tag: string }
}

test('Kysely (PostgresDialect) over edgepg Pool: CRUD and a rolled-back transaction', async () => {
  const pool = edgePool(proxy.port, { max: 3 })
  const db = new Kysely<Database>({ dialect: new PostgresDialect({ pool }) })
  try {
    const tag = 'kysely'

    const inserted = await db
      .insertInto(table)
      .values([{ name: 'apple', qty: 1, tag }, { name: 'pear', qty: 2, tag }])
      .returning(['id', 'name', 'qty', 'tag'])
      .execute()
    assert.equal(inserted.length, 2, 'insertInto … returning gives both rows')
    assert.ok(inserted.every((r) => Number.isInteger(r.id) && r.id > 0), 'returned rows carry serial ids')
    same(inserted.map(({ name, qty, tag }) => ({ name, qty, tag })), [{ name: 'apple', qty: 1, tag }, { name: 'pear', qty: 2, tag }], 'inserted rows')

    const pear = await db.selectFrom(table).selectAll().where('name', '=', 'pear').where('tag', '=', tag).execute()
    same(pear, [inserted[1]], 'selectFrom … where name = pear')

    const upd = await db.updateTable(table).set({ qty: 20 }).where('id', '=', inserted[1].id).executeTakeFirstOrThrow()
    assert.equal(upd.numUpdatedRows, 1n, 'updateTable reports one row updated')

    const del = await db.deleteFrom(table).where('id', '=', inserted[0].id).executeTakeFirstOrThrow()
    assert.equal(del.numDeletedRows, 1n, 'deleteFrom reports one row deleted')

    const left = await db.selectFrom(table).select(['name', 'qty']).where('tag', '=', tag).orderBy('id').execute()
    same(left, [{ name: 'pear', qty: 20 }], 'rows after update and delete')

    await db.transaction().execute(async (trx) => {
      await trx.insertInto(table).values({ name: 'plum', qty: 3, tag }).execute()
    })
    await assert.rejects(
      db.transaction().execute(async (trx) => {
        await trx.insertInto(table).values({ name: 'ghost', qty: 99, tag }).execute()
        await trx.updateTable(table).set({ qty: 0 }).where('name', '=', 'pear').where('tag', '=', tag).execute()
        const seen = await trx.selectFrom(table).select('id').where('name', '=', 'ghost').execute()
        assert.equal(seen.length, 1, 'the transaction sees its own insert')
        throw new Error('boom')
      }),
      /boom/,
      'transaction().execute rethrows the error'
    )
    same(await tcpRows(tag), [{ name: 'pear', qty: 20 }, { name: 'plum', qty: 3 }], 'over TCP: committed rows present, rolled-back insert/update absent')
    assert.equal(pool.totalCount - pool.idleCount, 0, 'no pool client left checked out')
  } finally {
    await db.destroy() // ends the pool
  }
})
