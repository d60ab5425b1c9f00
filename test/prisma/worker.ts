// A Worker (module syntax): Prisma (its workerd client) on @prisma/adapter-pg on edgepg's Pool,
// all made and ended inside the request. Bindings: PROXY_PORT, DATABASE_URL. Bundled by
// prisma.test.ts with `pg` aliased to edgepg, as docs/driver.md shows.
import { Pool } from 'edgepg'
import { PrismaPg } from '@prisma/adapter-pg'
import { PrismaClient, Prisma } from './generated/workerd/client'
import { runOps } from './ops'

export default {
  async fetch(request: Request, env: { PROXY_PORT: string; DATABASE_URL: string }, ctx: { waitUntil(p: Promise<unknown>): void }) {
    const pool = new Pool({ connectionString: env.DATABASE_URL, wsProxy: () => `ws://127.0.0.1:${env.PROXY_PORT}/v2`, max: 5 })
    const prisma = new PrismaClient({ adapter: new PrismaPg(pool) })
    try {
      const steps = await runOps(prisma, Prisma, new URL(request.url).searchParams.get('tag') ?? 'worker')
      return Response.json({ steps })
    } catch (err: any) {
      return Response.json({ error: `${err?.constructor?.name}: ${err?.message}`, code: err?.code }, { status: 500 })
    } finally {
      ctx.waitUntil(prisma.$disconnect().then(() => pool.end()))
    }
  },
}
