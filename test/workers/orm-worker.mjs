// A Worker run by test/orms-workerd.test.ts in workerd, bundled with esbuild as a user's app is
// (`pg` and `edgepg` aliased to the built driver). Each request makes its Pool (or HTTP client),
// runs the same CRUD and transactions through one ORM on a table of its own, and ends the Pool in
// ctx.waitUntil. Routes: /drizzle (drizzle-orm/node-postgres), /kysely, /neon-http (Drizzle's
// neon-http driver on @neondatabase/serverless, pointed at edgepg-proxy's /sql). Query:
// ?table=…&authOffload=false (SCRAM in the Worker). Bindings: PROXY_PORT, DATABASE_URL.
import { Pool } from 'edgepg'
import { drizzle } from 'drizzle-orm/node-postgres'
import { drizzle as drizzleHttp } from 'drizzle-orm/neon-http'
import { pgTable, serial, text, integer } from 'drizzle-orm/pg-core'
import { eq, asc, sql } from 'drizzle-orm'
import { Kysely, PostgresDialect, sql as ksql } from 'kysely'
import { neon, neonConfig } from '@neondatabase/serverless'

const items = (name) => pgTable(name, { id: serial('id').primaryKey(), name: text('name').notNull(), qty: integer('qty').notNull() })
const create = (table) => `CREATE TABLE ${table} (id serial PRIMARY KEY, name text NOT NULL, qty integer NOT NULL)`
const failure = (promise) => promise.then(() => 'no error', (err) => String(err?.message ?? err))
const pid = (rows) => rows[0].pid

/** Drizzle's CRUD, the same on either driver. */
async function drizzleCrud(db, t, table) {
  await db.execute(sql.raw(create(table)))
  return {
    inserted: await db.insert(t).values([{ name: 'apple', qty: 1 }, { name: 'pear', qty: 2 }]).returning(),
    selected: await db.select().from(t).where(eq(t.name, 'pear')),
    updated: await db.update(t).set({ qty: 20 }).where(eq(t.name, 'pear')).returning({ id: t.id, qty: t.qty }),
    deleted: await db.delete(t).where(eq(t.name, 'apple')).returning({ id: t.id }),
  }
}

async function withDrizzle(pool, table) {
  const db = drizzle({ client: pool })
  const t = items(table)
  return {
    ...(await drizzleCrud(db, t, table)),
    committed: await db.transaction(async (tx) => {
      await tx.insert(t).values({ name: 'plum', qty: 3 })
      return (await tx.select({ n: sql`count(*)::int` }).from(t))[0].n
    }),
    rolledBack: await failure(
      db.transaction(async (tx) => {
        await tx.insert(t).values({ name: 'ghost', qty: 99 })
        // Statements at once inside a transaction still share its one connection.
        const [a, b] = await Promise.all([tx.execute(sql`SELECT pg_backend_pid() AS pid`), tx.execute(sql`SELECT pg_backend_pid() AS pid`)])
        if (pid(a.rows) !== pid(b.rows)) throw new Error('a transaction ran on two connections')
        throw new Error('boom')
      })
    ),
    final: await db.select({ name: t.name, qty: t.qty }).from(t).orderBy(asc(t.id)),
  }
}

async function withKysely(pool, table) {
  const db = new Kysely({ dialect: new PostgresDialect({ pool }) })
  await ksql.raw(create(table)).execute(db)
  const count = async (trx) => (await trx.selectFrom(table).select(ksql`count(*)::int`.as('n')).executeTakeFirstOrThrow()).n
  return {
    inserted: await db.insertInto(table).values([{ name: 'apple', qty: 1 }, { name: 'pear', qty: 2 }]).returningAll().execute(),
    selected: await db.selectFrom(table).selectAll().where('name', '=', 'pear').execute(),
    updated: await db.updateTable(table).set({ qty: 20 }).where('name', '=', 'pear').returning(['id', 'qty']).execute(),
    deleted: await db.deleteFrom(table).where('name', '=', 'apple').returning('id').execute(),
    committed: await db.transaction().execute(async (trx) => {
      await trx.insertInto(table).values({ name: 'plum', qty: 3 }).execute()
      return count(trx)
    }),
    rolledBack: await failure(
      db.transaction().execute(async (trx) => {
        await trx.insertInto(table).values({ name: 'ghost', qty: 99 }).execute()
        const [a, b] = await Promise.all([ksql`SELECT pg_backend_pid() AS pid`.execute(trx), ksql`SELECT pg_backend_pid() AS pid`.execute(trx)])
        if (pid(a.rows) !== pid(b.rows)) throw new Error('a transaction ran on two connections')
        throw new Error('boom')
      })
    ),
    final: await db.selectFrom(table).select(['name', 'qty']).orderBy('id').execute(),
  }
}

async function withNeonHttp(env, table) {
  neonConfig.fetchEndpoint = `http://127.0.0.1:${env.PROXY_PORT}/sql` // @neondatabase/serverless reads it only from neonConfig
  const db = drizzleHttp({ client: neon(env.DATABASE_URL) })
  const t = items(table)
  return {
    ...(await drizzleCrud(db, t, table)),
    // db.batch is one POST /sql, one transaction.
    committed: (await db.batch([db.insert(t).values({ name: 'plum', qty: 3 }), db.select({ n: sql`count(*)::int` }).from(t)]))[1][0].n,
    rolledBack: await failure(db.batch([db.insert(t).values({ name: 'ghost', qty: 99 }), db.execute(sql`SELECT 1/0`)])),
    final: await db.select({ name: t.name, qty: t.qty }).from(t).orderBy(asc(t.id)),
  }
}

export default {
  async fetch(request, env, ctx) {
    const url = new URL(request.url)
    const table = url.searchParams.get('table')
    try {
      if (url.pathname === '/neon-http') return Response.json(await withNeonHttp(env, table))
      const orm = { '/drizzle': withDrizzle, '/kysely': withKysely }[url.pathname]
      if (!orm) return Response.json({ error: `no route ${url.pathname}` }, { status: 404 })
      const pool = new Pool({ connectionString: env.DATABASE_URL, wsProxy: () => `ws://127.0.0.1:${env.PROXY_PORT}/v2`, max: 3, authOffload: url.searchParams.get('authOffload') !== 'false' })
      try {
        return Response.json({ ...(await orm(pool, table)), checkedOut: pool.totalCount - pool.idleCount })
      } finally {
        ctx.waitUntil(pool.end())
      }
    } catch (err) {
      return Response.json({ error: String(err?.message ?? err), stack: String(err?.stack ?? '') }, { status: 500 })
    }
  },
}
