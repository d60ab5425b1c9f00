// A Worker that keeps its Pool, httpSql and one Client at module scope, as ORMs' docs write them,
// run by test/workers-module-scope.test.ts on the BUILT driver. Requests: ?mode=pool (two queries
// at once, so two connections), ?mode=tx (a transaction on pool.connect()), ?mode=http, and
// ?mode=client (the module-scope Client, connected by the first such request only).
import { env } from 'cloudflare:workers'
import { Client, Pool, httpSql } from '../../dist/index.mjs'

const wsProxy = () => `ws://127.0.0.1:${env.PROXY_PORT}/v2`
const pool = new Pool({ connectionString: env.DATABASE_URL, wsProxy, application_name: env.APP })
const sql = httpSql(env.DATABASE_URL, { fetchEndpoint: `http://127.0.0.1:${env.PROXY_PORT}/sql` })
const client = new Client({ connectionString: env.DATABASE_URL, wsProxy, application_name: `${env.APP}-client` })
let clientConnected

const PID = 'SELECT pg_backend_pid() AS pid, $1::int AS n'

export default {
  async fetch(request) {
    const url = new URL(request.url)
    const mode = url.searchParams.get('mode')
    const n = Number(url.searchParams.get('n'))
    try {
      let rows
      if (mode === 'pool') {
        const [a, b] = await Promise.all([pool.query(PID, [n]), pool.query(PID, [n + 1])])
        rows = [...a.rows, ...b.rows]
      } else if (mode === 'tx') {
        const c = await pool.connect()
        try {
          await c.query('BEGIN')
          rows = (await c.query(PID, [n])).rows
          await c.query('COMMIT')
        } finally {
          c.release()
        }
      } else if (mode === 'http') {
        rows = await sql.query('SELECT $1::int AS n', [n])
      } else if (mode === 'client') {
        clientConnected ??= client.connect()
        await clientConnected
        rows = (await client.query(PID, [n])).rows
      }
      return Response.json({ rows, max: pool.options.max })
    } catch (err) {
      return Response.json({ error: String(err?.message ?? err) }, { status: 500 })
    }
  },
}
