// A Drizzle app written for @neondatabase/serverless, unchanged, with edgepg installed under Neon's
// name (docs/neon.md). Run by test/neon-alias.test.ts in a fresh project, on the packed
// tarball; it is also type-checked there with `tsc`, with no casts. Prints one JSON line.
import { Pool, neon, neonConfig, NeonDbError, type NeonQueryFunction } from '@neondatabase/serverless'
import { drizzle as drizzleWs } from 'drizzle-orm/neon-serverless'
import { drizzle as drizzleHttp } from 'drizzle-orm/neon-http'
import { pgTable, text } from 'drizzle-orm/pg-core'
import { eq, sql } from 'drizzle-orm'
import ws from 'ws'

const { DATABASE_URL, PROXY, TABLE } = process.env as Record<string, string>
neonConfig.webSocketConstructor = ws
neonConfig.wsProxy = () => `${PROXY.replace(/^http/, 'ws')}/v2`
neonConfig.fetchEndpoint = `${PROXY}/sql`

const items = pgTable(TABLE, { tag: text('tag').notNull(), name: text('name').notNull() })
const out: Record<string, unknown> = {}

// neon-serverless: transactions on one backend, statements at once inside one, and a rollback
// that takes nothing else with it.
const pool = new Pool({ connectionString: DATABASE_URL, max: 2 })
const db = drizzleWs({ client: pool })
await db.transaction(async (tx) => {
  await tx.insert(items).values({ tag: 'ws', name: 'committed' })
})
let seenInside = 0
let pids: number[] = []
const rolledBack = db.transaction(async (tx) => {
  await tx.insert(items).values({ tag: 'ws', name: 'rolled back' })
  const [a, b] = await Promise.all([tx.execute(sql`SELECT pg_backend_pid() AS pid`), tx.execute(sql`SELECT pg_backend_pid() AS pid`)])
  pids = [a.rows[0].pid as number, b.rows[0].pid as number]
  seenInside = (await tx.select().from(items).where(eq(items.name, 'rolled back'))).length
  // Another request's write, meanwhile, on the Pool: it must not land inside this transaction.
  await db.insert(items).values({ tag: 'ws', name: 'other request' })
  throw new Error('boom')
})
out.rollback = await rolledBack.then(() => 'committed?!', (err: Error) => err.message)
Object.assign(out, { seenInside, samePid: pids[0] === pids[1] })
await pool.end()

// neon-http: neon() as Drizzle's client, db.batch in one transaction.
const client: NeonQueryFunction<false, false> = neon(DATABASE_URL)
const http = drizzleHttp({ client })
const [, inBatch] = await http.batch([http.insert(items).values({ tag: 'http', name: 'batched' }), http.select().from(items).where(eq(items.tag, 'http'))])
out.batch = inBatch.map((r) => r.name)
out.neonDbError = await client`SELECT 1/0`.then(() => 'no error?!', (err: unknown) => err instanceof NeonDbError && (err as { code?: string }).code)

console.log(JSON.stringify(out))
